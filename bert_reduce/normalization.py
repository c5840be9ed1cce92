"""Normalization modes: what the summed masked-token loss is divided by, exactly, under any split.

Every mode turns one micro-batch's ``[b, s]`` per-token loss and mask into a
``(numerator, denominator)`` pair whose sums over micro-batches and ranks, divided once, give
the global value (``docs/normalization.md``): ``per_token`` (default; the mean over every
scored token), ``per_sequence`` (the mean over sequences of each sequence's token mean) and
``constant`` (the summed loss over ``constant_per_sequence`` times the number of sequences).
A sequence's totals travel as two per-token ``[b, s]`` tensors computed once on the unsliced
batch (:func:`sequence_normalizers`: ``sequence_weight``, ``sequence_start``) and sliced,
split and packed like any other token tensor, so context-parallel shards and packed slices
stay exact.

:func:`token_loss_sum` turns per-token losses into a mode's ``(numerator, denominator)``
(``masked_token_loss`` is NeMo's and BioNeMo's name for it); :func:`normalization_weights`
gives each token's coefficient before any loss exists, for the fused head.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor

from bert_reduce.functional import (
    accumulation_dtype,
    check_same_device,
    check_same_shape,
    mask_weights,
    token_denominator,
    token_weighted_sum,
)

__all__ = [
    "Normalization",
    "checked_normalization",
    "normalization_weights",
    "sequence_normalizers",
    "token_loss_sum",
]


class Normalization(str, Enum):
    """What the summed loss of the global batch is divided by."""

    PER_TOKEN = "per_token"
    PER_SEQUENCE = "per_sequence"
    CONSTANT = "constant"


def _mode(normalization: Normalization | str) -> Normalization:
    """The :class:`Normalization` of a mode or its name; ``ValueError`` listing the valid ones."""
    try:
        return Normalization(normalization)
    except ValueError:
        valid = ", ".join(repr(mode.value) for mode in Normalization)
        raise ValueError(
            f"{normalization!r} is not a normalization; choose one of {valid}."
        ) from None


def checked_normalization(
    normalization: Normalization | str, constant_per_sequence: int | None
) -> Normalization:
    """The mode, once ``constant`` is known to have its positive ``constant_per_sequence``.

    Raises:
        ValueError: On an unknown mode, or ``constant`` without a positive
            ``constant_per_sequence``.
    """
    normalization = _mode(normalization)
    if normalization is Normalization.CONSTANT and (
        constant_per_sequence is None or constant_per_sequence <= 0
    ):
        raise ValueError(
            "normalization='constant' needs a positive constant_per_sequence (e.g. the maximum "
            f"sequence length), got {constant_per_sequence!r}."
        )
    return normalization


def sequence_normalizers(
    loss_mask: Tensor, cu_seqlens: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token sequence totals and sequence markers, from an unsliced batch.

    Compute these before context-parallel slicing or micro-batch splitting (or on a packed
    row with its global ``cu_seqlens``), then slice them with the batch. No host sync.

    Args:
        loss_mask: ``[b, s]`` bool, integer or float weights. Without ``cu_seqlens`` each row
            is one sequence; with it, ``b`` must be 1 (one packed row).
        cu_seqlens: ``[n + 1]`` integer boundaries of ``n`` packed sequences within the row
            (the padded boundaries when sequences are padded); positions past
            ``cu_seqlens[-1]`` belong to no sequence. Empty segments are not sequences.

    Returns:
        ``(sequence_weight, sequence_start)``: ``[b, s]`` total weight of each token's
        sequence (mask dtype widened: int64 for bool/integer masks, fp64 for float ones; 0
        outside any sequence), and a ``[b, s]`` bool that is ``True`` on the first token of
        each sequence.

    Raises:
        ValueError: If ``cu_seqlens`` is given for a mask that is not a single ``[1, T]`` row.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [b, s], got shape {tuple(loss_mask.shape)}.")
    weights = mask_weights(loss_mask)
    if cu_seqlens is None:
        sequence_weight = weights.sum(dim=1, keepdim=True).expand_as(weights).contiguous()
        sequence_start = torch.zeros_like(loss_mask, dtype=torch.bool)
        sequence_start[:, :1] = True  # `:1`, not `0`: a [b, 0] mask has no first token
        return sequence_weight, sequence_start
    if loss_mask.size(0) != 1:
        raise ValueError(
            f"cu_seqlens describes one packed row, but loss_mask has shape "
            f"{tuple(loss_mask.shape)}; expected [1, T]."
        )
    cu_seqlens = cu_seqlens.to(device=loss_mask.device, dtype=torch.int64)
    num_sequences = cu_seqlens.numel() - 1
    positions = torch.arange(loss_mask.size(1), device=loss_mask.device)
    # Sequence id of each position; id num_sequences collects the trailing positions that
    # belong to no sequence, so that index_add never needs a data-dependent size.
    seq_id = torch.searchsorted(cu_seqlens[1:], positions, right=True).clamp(max=num_sequences)
    totals = torch.zeros(num_sequences + 1, dtype=weights.dtype, device=weights.device)
    totals.index_add_(0, seq_id, weights[0])
    totals[num_sequences] = 0
    starts = torch.cat([cu_seqlens[:-1], cu_seqlens.new_full((1,), -1)])
    sequence_start = (positions == starts[seq_id]) & (seq_id < num_sequences)
    return totals[seq_id].unsqueeze(0), sequence_start.unsqueeze(0)


def token_loss_sum(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    normalization: Normalization | str = Normalization.PER_TOKEN,
    *,
    sequence_weight: Tensor | None = None,
    sequence_start: Tensor | None = None,
    constant_per_sequence: int | None = None,
    weight_resolution: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``[b, s]`` per-token losses and mask -> ``(loss_sum, denominator)`` in a mode.

    The numerator and denominator of one micro-batch (or one shard of it): sums of these over
    every micro-batch and rank, divided once, give the global value. In the default
    ``per_token`` mode, ``loss_sum = sum(mask * loss)`` over the scored positions and
    ``denominator`` is :func:`bert_reduce.functional.token_denominator` (the token count). The
    numerator carries the gradient; unscored positions (mask 0) never reach it, even when
    their loss is NaN or inf. No host sync, no collective.

    Weights (a float ``loss_mask``) are expected to be non-negative. Megatron-Core adds the
    denominators of a step into an int32 tensor, which raises on a float denominator: for a
    float mask in ``per_token`` mode, pass ``weight_resolution=R`` to round every weight to a
    multiple of ``1 / R`` and express the weights as integers (``round(w * R)``); the
    denominator is then an exact int64 and the scale ``R`` cancels in the ratio. Weights that
    already are multiples of ``1 / R`` (0.5, 0.25, ... for ``R = 256``) are then exact.

    Args:
        per_token_loss: ``[b, s]`` per-token losses (any float dtype).
        loss_mask: ``[b, s]`` bool/integer (0/1) or float weights; non-zero where scored.
        normalization: The mode (a :class:`Normalization` or its string value).
        sequence_weight: ``[b, s]``, see :func:`sequence_normalizers`; computed from
            ``loss_mask`` with each row as one sequence when omitted. Must come from the
            unsliced batch under context parallelism or packing.
        sequence_start: ``[b, s]`` bool, see :func:`sequence_normalizers`; same default.
        constant_per_sequence: The ``constant`` mode's denominator per sequence (e.g. the
            maximum sequence length). Required in that mode only.
        weight_resolution: For float masks in ``per_token`` mode, give an integer
            denominator by rounding weights to multiples of ``1 / weight_resolution``.

    Returns:
        ``(numerator, denominator)``: a 0-dim numerator in fp32 (fp64 for fp64 losses) and a
        0-dim denominator: int64 in every mode except ``per_token`` with a float mask and no
        ``weight_resolution``, where it is the fp64 sum of weights.

    Raises:
        ValueError: On mismatched shapes, an unknown mode, or a missing or non-positive
            ``constant_per_sequence`` in ``constant`` mode.
    """
    normalization = _mode(normalization)
    check_same_shape(per_token_loss, loss_mask, ("per_token_loss", "loss_mask"), "[b, s]")
    check_same_device(per_token_loss, loss_mask, ("per_token_loss", "loss_mask"))
    coefficients, scored, denominator = _coefficients(
        loss_mask,
        normalization,
        accumulation_dtype(per_token_loss.dtype),
        sequence_weight,
        sequence_start,
        constant_per_sequence,
        weight_resolution,
    )
    return token_weighted_sum(per_token_loss, coefficients, scored), denominator


masked_token_loss = token_loss_sum
"""NeMo 2's name (``nemo.lightning.megatron_parallel.masked_token_loss``, which BioNeMo uses):
``masked_token_loss(per_token_loss, loss_mask)`` -> ``(loss_sum, denominator)``, for code
ported from them (``docs/bionemo.md``). The same function as :func:`token_loss_sum`: NeMo's
contract, with an exact int64 count and no NaN from unscored positions."""


def normalization_weights(
    loss_mask: Tensor,
    normalization: Normalization | str = Normalization.PER_TOKEN,
    *,
    dtype: torch.dtype = torch.float32,
    sequence_weight: Tensor | None = None,
    sequence_start: Tensor | None = None,
    constant_per_sequence: int | None = None,
    weight_resolution: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Each token's coefficient in a mode's numerator, and its denominator, before any loss.

    ``sum(token_weights * per_token_loss)`` over ``token_weights != 0`` is
    :func:`token_loss_sum`'s numerator: a weighted sum whose weights the mask and the
    sequence boundaries fix in the forward, which is what lets
    :func:`bert_reduce.linear_cross_entropy_weighted_sum` accumulate the
    gradients during the forward. No host sync, no collective.

    Args:
        loss_mask: ``[b, s]`` bool/integer (0/1) or float weights; non-zero where scored.
        normalization: The mode (a :class:`Normalization` or its string value).
        dtype: The coefficients' dtype: the loss's accumulation dtype (fp32, fp64 for fp64).
        sequence_weight: As in :func:`token_loss_sum`.
        sequence_start: As in :func:`token_loss_sum`.
        constant_per_sequence: As in :func:`token_loss_sum`.
        weight_resolution: As in :func:`token_loss_sum`.

    Returns:
        ``(token_weights, denominator)``: ``[b, s]`` coefficients in ``dtype``, exactly 0
        where a token does not reach the numerator and NaN on a negative weight (which makes
        the sum NaN, as in :func:`bert_reduce.functional.token_weighted_sum`); and the 0-dim
        denominator of :func:`token_loss_sum`.

    Raises:
        ValueError: As :func:`token_loss_sum`.
    """
    coefficients, scored, denominator = _coefficients(
        loss_mask,
        normalization,
        dtype,
        sequence_weight,
        sequence_start,
        constant_per_sequence,
        weight_resolution,
    )
    coefficients = torch.where(coefficients < 0, torch.nan, coefficients)
    return torch.where(scored, coefficients, 0), denominator


def _coefficients(
    loss_mask: Tensor,
    normalization: Normalization | str,
    acc: torch.dtype,
    sequence_weight: Tensor | None,
    sequence_start: Tensor | None,
    constant_per_sequence: int | None,
    weight_resolution: int | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(coefficients, scored, denominator)``: numerator = sum of coefficients * loss on scored.

    The one definition of every mode's weights, shared by :func:`token_loss_sum` and
    :func:`normalization_weights`. ``coefficients`` are ``[b, s]`` in ``acc`` (any value off
    ``scored``), ``scored`` the ``[b, s]`` bool of the tokens that reach the numerator.
    """
    normalization = _mode(normalization)
    scored = loss_mask != 0

    if normalization is Normalization.PER_TOKEN:
        if loss_mask.dtype.is_floating_point and weight_resolution is not None:
            int_weights = torch.round(loss_mask.to(torch.float64) * weight_resolution).long()
            return int_weights.to(acc), int_weights != 0, int_weights.sum()
        return loss_mask.to(acc), scored, token_denominator(loss_mask)

    if sequence_weight is None or sequence_start is None:
        sequence_weight, sequence_start = sequence_normalizers(loss_mask)
    check_same_shape(sequence_weight, loss_mask, ("sequence_weight", "loss_mask"), "[b, s]")
    check_same_shape(sequence_start, loss_mask, ("sequence_start", "loss_mask"), "[b, s]")
    sequence_start = sequence_start != 0

    if normalization is Normalization.PER_SEQUENCE:
        has_tokens = sequence_weight != 0
        # A scored token's sequence weight is non-zero; the `where` keeps the division safe on
        # the others without a host-side check.
        per_token_weight = loss_mask.to(acc) / torch.where(has_tokens, sequence_weight, 1).to(acc)
        num_sequences = (sequence_start & has_tokens).sum(dtype=torch.int64)
        return per_token_weight, scored & has_tokens, num_sequences

    checked_normalization(normalization, constant_per_sequence)
    denominator = sequence_start.sum(dtype=torch.int64) * constant_per_sequence
    return loss_mask.to(acc), scored, denominator
