"""Normalization modes: what the summed masked-token loss is divided by, exactly, under any split.

The modes (``per_token``, ``per_sequence``, ``constant``) and why each stays exact under
micro-batches, context-parallel shards and packing: ``docs/normalization.md``.
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


def checked_normalization(
    normalization: Normalization | str, constant_per_sequence: int | None
) -> Normalization:
    """The mode, once ``constant`` is known to have its positive ``constant_per_sequence``.

    Raises:
        ValueError: On an unknown mode (the message lists the valid ones), or ``constant``
            without a positive ``constant_per_sequence``.
    """
    try:
        normalization = Normalization(normalization)
    except ValueError:
        valid = ", ".join(repr(mode.value) for mode in Normalization)
        raise ValueError(
            f"{normalization!r} is not a normalization; choose one of {valid}."
        ) from None
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
    """Per-token sequence totals and sequence markers, from an unsliced batch; no host sync.

    Args:
        loss_mask: ``[b, s]`` bool, integer or float weights. Without ``cu_seqlens`` each row
            is one sequence; with it, ``b`` must be 1 (one packed row).
        cu_seqlens: ``[n + 1]`` (padded) boundaries of ``n`` packed sequences within the row;
            positions past ``cu_seqlens[-1]``, and empty segments, are no sequence.

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

    The pair of one micro-batch (or shard) in a mode of ``docs/normalization.md``. The
    numerator carries the gradient; unscored positions never reach it, even when their loss is
    NaN or inf. No host sync, no collective.

    Args:
        per_token_loss: ``[b, s]`` per-token losses (any float dtype).
        loss_mask: ``[b, s]`` bool/integer (0/1) or float weights; non-zero where scored.
        normalization: The mode (a :class:`Normalization` or its string value).
        sequence_weight: ``[b, s]``, :func:`sequence_normalizers`' on the unsliced batch; by
            default each row of ``loss_mask`` is one sequence.
        sequence_start: ``[b, s]`` bool, see :func:`sequence_normalizers`; same default.
        constant_per_sequence: The ``constant`` mode's denominator per sequence (e.g. the
            maximum sequence length). Required in that mode only.
        weight_resolution: For float masks in ``per_token`` mode, an exact int64 denominator
            (Megatron's int32 counter needs one) by rounding weights to multiples of
            ``1 / weight_resolution`` (``docs/normalization.md``).

    Returns:
        ``(numerator, denominator)``: a 0-dim numerator in fp32 (fp64 for fp64 losses) and a
        0-dim denominator: int64 in every mode except ``per_token`` with a float mask and no
        ``weight_resolution``, where it is the fp64 sum of weights.

    Raises:
        ValueError: On mismatched shapes, an unknown mode, or a missing or non-positive
            ``constant_per_sequence`` in ``constant`` mode.

    Example:
        >>> losses = torch.tensor([[1.0, 9.0, 3.0], [5.0, float("nan"), 0.0]])
        >>> mask = torch.tensor([[True, False, True], [True, False, False]])
        >>> token_loss_sum(losses, mask)  # (1 + 3 + 5, 3 tokens)
        (tensor(9.), tensor(3))
        >>> token_loss_sum(losses, mask, "per_sequence")  # (mean 2 + mean 5, 2 sequences)
        (tensor(7.), tensor(2))
    """
    check_same_shape(per_token_loss, loss_mask, ("per_token_loss", "loss_mask"), "[b, s]")
    check_same_device(per_token_loss, loss_mask, ("per_token_loss", "loss_mask"))
    weights, denominator = normalization_weights(
        loss_mask,
        normalization,
        dtype=accumulation_dtype(per_token_loss.dtype),
        sequence_weight=sequence_weight,
        sequence_start=sequence_start,
        constant_per_sequence=constant_per_sequence,
        weight_resolution=weight_resolution,
    )
    # `where` rather than a product alone: a NaN or inf loss where the weight is 0 (padding
    # labels, say) must reach neither the sum nor the gradient.
    terms = torch.where(weights != 0, per_token_loss.to(weights.dtype) * weights, 0)
    return terms.sum(), denominator


masked_token_loss = token_loss_sum
"""NeMo 2's and BioNeMo's name for :func:`token_loss_sum`, for ported code (``docs/bionemo.md``)."""


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
    :func:`token_loss_sum`'s numerator, with weights fixed before the forward (what lets the
    fused head accumulate its gradients in the forward). No host sync, no collective. The
    arguments are :func:`token_loss_sum`'s, and ``dtype``, the coefficients' dtype.

    Returns:
        ``(token_weights, denominator)``: ``[b, s]`` coefficients in ``dtype``, exactly 0
        where a token does not reach the numerator and NaN on a negative weight (which makes
        the sum NaN); and the 0-dim denominator of :func:`token_loss_sum`.

    Raises:
        ValueError: As :func:`token_loss_sum`.
    """
    normalization = checked_normalization(normalization, constant_per_sequence)
    scored, coefficients = loss_mask != 0, loss_mask.to(dtype)
    rounded = loss_mask.dtype.is_floating_point and weight_resolution is not None
    if normalization is Normalization.PER_TOKEN and rounded:
        int_weights = torch.round(loss_mask.to(torch.float64) * weight_resolution).long()
        coefficients, scored = int_weights.to(dtype), int_weights != 0
        denominator = int_weights.sum()
    elif normalization is Normalization.PER_TOKEN:
        denominator = token_denominator(loss_mask)
    else:
        if sequence_weight is None or sequence_start is None:
            sequence_weight, sequence_start = sequence_normalizers(loss_mask)
        check_same_shape(sequence_weight, loss_mask, ("sequence_weight", "loss_mask"), "[b, s]")
        check_same_shape(sequence_start, loss_mask, ("sequence_start", "loss_mask"), "[b, s]")
        sequence_start = sequence_start != 0
        if normalization is Normalization.CONSTANT:
            denominator = sequence_start.sum(dtype=torch.int64) * constant_per_sequence
        else:
            has_tokens = sequence_weight != 0
            # A scored token's sequence weight is non-zero; the `where` keeps the division safe
            # on the others without a host-side check.
            coefficients = coefficients / torch.where(has_tokens, sequence_weight, 1).to(dtype)
            scored = scored & has_tokens
            denominator = (sequence_start & has_tokens).sum(dtype=torch.int64)
    # A weight counts how often a token is scored: a negative one makes the sum NaN, as an
    # out-of-vocabulary label does (checking its sign on the host would be a sync).
    coefficients = torch.where(coefficients < 0, torch.nan, coefficients)
    return torch.where(scored, coefficients, 0), denominator
