"""Per-token masked-LM losses of a Hugging Face batch, and their ``(numerator, denominator)``.

What :class:`~bert_reduce.hf.ExactMLMTrainer` computes for each micro-batch, built from the
library's maths (:func:`bert_reduce.cross_entropy_token_losses`,
:func:`bert_reduce.linear_cross_entropy_loss_sum`,
:func:`bert_reduce.linear_cross_entropy_token_losses`,
:func:`bert_reduce.normalization.token_loss_sum`,
:func:`bert_reduce.packing.batch_sequence_normalizers`):

* :func:`split_model_inputs`: the batch's keys the model takes, without the loss's;
* :func:`scored_weights`: the ``[b, s]`` weights of the scored tokens (labels and
  ``loss_mask``);
* :func:`fused_head_loss_terms`: a training batch's ``(numerator, denominator)`` through the
  masked-only fused head, gradients accumulated in the forward;
* :func:`masked_lm_token_losses`: the ``[b, s]`` per-token losses, from the model's logits or
  from the fused head (evaluation, which needs each token's loss);
* :func:`batch_loss_terms`: one batch's ``(numerator, denominator)`` in a normalization mode;
* :func:`sample_loss_terms`: the same per sample (a row, or a packed sequence), for evaluation
  sets whose padding duplicates are dropped sample by sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from bert_reduce.cross_entropy import cross_entropy_token_losses
from bert_reduce.functional import check_same_shape
from bert_reduce.hf.lm_head import lm_head_inputs
from bert_reduce.linear_cross_entropy import (
    HIDDEN_STATES_KEY,
    OUTPUT_BIAS_KEY,
    OUTPUT_WEIGHT_KEY,
    linear_cross_entropy_loss_sum,
    linear_cross_entropy_token_losses,
)
from bert_reduce.normalization import Normalization, token_loss_sum
from bert_reduce.packing import batch_sequence_normalizers

__all__ = [
    "LOSS_ONLY_KEYS",
    "batch_loss_terms",
    "fused_head_loss_terms",
    "masked_lm_token_losses",
    "sample_loss_terms",
    "scored_weights",
    "split_model_inputs",
]

LOSS_ONLY_KEYS = ("labels", "loss_mask", "sequence_weight", "sequence_start", "num_scored")
"""Batch keys the loss reads and the model is not given. ``labels`` is kept from the model
so that it computes no loss of its own (and ``[b, s, v]`` logits are not scored twice)."""


def split_model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch without :data:`LOSS_ONLY_KEYS`: what the model's ``forward`` receives.

    Packing keys (``position_ids``, ``cu_seq_lens_q``, ...) stay: the model's attention needs
    them, and the loss reads them from the batch as well.
    """
    return {key: value for key, value in batch.items() if key not in LOSS_ONLY_KEYS}


def scored_weights(batch: Mapping[str, Any], ignore_index: int = -100) -> Tensor:
    """The ``[b, s]`` weights of a batch's scored tokens.

    ``loss_mask`` where the batch has one (bool, integer or float weights), else 1; 0 wherever
    the label is ``ignore_index``.

    Raises:
        KeyError: If the batch has no ``labels``.
        ValueError: If ``labels`` is not ``[b, s]`` or ``loss_mask`` has another shape.
    """
    if "labels" not in batch:
        raise KeyError(
            f"The batch has no 'labels' (the masked tokens' ids, {ignore_index} elsewhere); "
            f"it has {sorted(batch)}."
        )
    labels = batch["labels"]
    if labels.dim() != 2:
        raise ValueError(f"labels must be [b, s], got shape {tuple(labels.shape)}.")
    labelled = labels != ignore_index
    mask = batch.get("loss_mask")
    if mask is None:
        return labelled
    check_same_shape(mask, labels, ("loss_mask", "labels"), "[b, s]")
    return torch.where(labelled, mask, torch.zeros_like(mask))


def fused_head_loss_terms(
    model: nn.Module,
    batch: Mapping[str, Any],
    weights: Tensor,
    normalization: Normalization,
    constant_per_sequence: int | None,
    *,
    num_scored: int | None = None,
) -> tuple[Tensor, Tensor]:
    """A batch's ``(numerator, denominator)`` in a mode, through the masked-only fused head.

    :func:`bert_reduce.hf.lm_head_inputs` runs the model up to its decoder, then
    :func:`bert_reduce.linear_cross_entropy_loss_sum` computes the scored rows' logits only
    and, the mode's weights being known in the forward, accumulates the gradients there
    (three products per scored row, none recomputed in backward). The ``[b, s, v]`` logits
    never exist.

    Args:
        model: An ``EsmForMaskedLM`` or ``BertForMaskedLM`` (possibly inside DDP).
        batch: The batch: the model's inputs, ``labels`` ``[b, s]``, and the loss's keys; its
            sequences as :func:`batch_loss_terms` finds them.
        weights: ``[b, s]`` :func:`scored_weights` of the batch.
        normalization: The mode.
        constant_per_sequence: The constant mode's denominator per sequence.
        num_scored: The number of scored tokens of the batch, read on the host, so that
            exactly those rows are computed without a host sync; ``None`` counts them on the
            device (one host sync on an accelerator).

    Returns:
        0-dim numerator (carrying the gradients) and denominator, as
        :func:`batch_loss_terms` returns them.
    """
    forward_out = lm_head_inputs(model, **split_model_inputs(batch))
    sequences = {}
    if normalization is not Normalization.PER_TOKEN:
        sequences = batch_sequence_normalizers(batch, weights)
    # Unscored labels (-100) are never read by the loss, but must be valid gather indices.
    targets = torch.where(weights != 0, batch["labels"], 0)
    return linear_cross_entropy_loss_sum(
        forward_out[HIDDEN_STATES_KEY],
        forward_out[OUTPUT_WEIGHT_KEY],
        targets,
        weights,
        normalization,
        bias=forward_out[OUTPUT_BIAS_KEY],
        layout="bsh",
        **({} if num_scored is None else {"num_scored": num_scored}),
        **sequences,
        constant_per_sequence=constant_per_sequence,
    )


def masked_lm_token_losses(
    model: nn.Module,
    batch: Mapping[str, Any],
    weights: Tensor,
    *,
    fused_head: bool,
    num_scored: int | None = None,
) -> tuple[Tensor, Any]:
    """``[b, s]`` per-token losses of a batch (0 where unscored), and the model's outputs.

    Args:
        model: A Hugging Face masked LM (possibly inside DDP); with ``fused_head`` an
            ``EsmForMaskedLM`` or ``BertForMaskedLM``.
        batch: The batch: the model's inputs, ``labels`` ``[b, s]``, and the loss's keys.
        weights: ``[b, s]`` :func:`scored_weights` of the batch.
        fused_head: Compute the losses with the masked-only fused head
            (:func:`bert_reduce.hf.lm_head_inputs`, then
            :func:`bert_reduce.linear_cross_entropy_token_losses`): the ``[b, s, v]`` logits
            are never formed. Otherwise from the model's ``[b, s, v]`` ``logits``. To train
            (only the loss's sum needed), :func:`fused_head_loss_terms` is faster.
        num_scored: With ``fused_head``, the number of scored tokens of the batch, read on
            the host, so that exactly those rows are computed without a host sync; ``None``
            counts them on the device (one host sync on an accelerator).

    Returns:
        ``(per_token_loss, outputs)``: ``[b, s]`` losses in fp32 (fp64 for fp64 models), and
        the model's output (``None`` with ``fused_head``, which has no logits to give).
    """
    labels = batch["labels"]
    # Unscored labels (-100) are never read by the losses, but must be valid gather indices.
    targets = torch.where(weights != 0, labels, 0)
    inputs = split_model_inputs(batch)
    if fused_head:
        forward_out = lm_head_inputs(model, **inputs)
        capacity_kwargs: dict[str, Any] = {} if num_scored is None else {"num_scored": num_scored}
        losses = linear_cross_entropy_token_losses(
            forward_out[HIDDEN_STATES_KEY],
            forward_out[OUTPUT_WEIGHT_KEY],
            targets,
            weights,
            bias=forward_out[OUTPUT_BIAS_KEY],
            layout="bsh",
            **capacity_kwargs,
        )
        return losses, None
    outputs = model(**inputs)
    logits = outputs.logits
    if logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(
            f"The model's logits of shape {tuple(logits.shape)} must be [b, s, v] for labels of "
            f"shape {tuple(labels.shape)}."
        )
    # The kernel reads [s, b, v]; [b, s, v] is that layout with b and s swapped, so it is
    # passed as is (no copy) with transposed labels and mask.
    losses = cross_entropy_token_losses(logits, targets.t(), weights.t()).t()
    return losses, outputs


def batch_loss_terms(
    batch: Mapping[str, Any],
    weights: Tensor,
    per_token_loss: Tensor | None,
    normalization: Normalization,
    constant_per_sequence: int | None,
) -> tuple[Tensor, Tensor]:
    """``(numerator, denominator)`` of one batch in a normalization mode; no collective.

    Args:
        batch: The batch; its sequences (rows, or packed sequences by Hugging Face's
            ``position_ids`` / ``cu_seq_lens_q`` keys, or ``sequence_weight`` and
            ``sequence_start``) are found by :func:`bert_reduce.packing.batch_sequence_normalizers`.
        weights: ``[b, s]`` :func:`scored_weights`.
        per_token_loss: ``[b, s]`` losses, or ``None`` for the denominator alone (the
            numerator is then 0).
        normalization: The mode.
        constant_per_sequence: The constant mode's denominator per sequence.

    Returns:
        0-dim numerator (carrying the gradient) and denominator, as
        :func:`bert_reduce.normalization.token_loss_sum` returns them.
    """
    if per_token_loss is None:
        per_token_loss = torch.zeros(weights.shape, dtype=torch.float32, device=weights.device)
    sequences = {}
    if normalization is not Normalization.PER_TOKEN:
        sequences = batch_sequence_normalizers(batch, weights)
    return token_loss_sum(
        per_token_loss,
        weights,
        normalization,
        **sequences,
        constant_per_sequence=constant_per_sequence,
    )


def sample_loss_terms(
    batch: Mapping[str, Any],
    weights: Tensor,
    per_token_loss: Tensor,
    normalization: Normalization,
    constant_per_sequence: int | None,
) -> Tensor:
    """``[n, 2]`` fp64 ``(numerator, denominator)`` of each of a batch's ``n`` samples.

    Their sum over samples is :func:`batch_loss_terms`. A sample is a row of a ``[b, s]``
    batch, or a sequence of a packed one (in order): the unit a distributed evaluation
    sampler pads with duplicates and ``accelerate``'s ``gather_for_metrics`` drops again.
    Reads the number of packed sequences on the host (an evaluation-time sync).

    Args:
        batch: The batch (see :func:`batch_loss_terms`).
        weights: ``[b, s]`` :func:`scored_weights`.
        per_token_loss: ``[b, s]`` losses.
        normalization: The mode.
        constant_per_sequence: The constant mode's denominator per sequence.

    Returns:
        ``[n, 2]`` fp64, detached.
    """
    sequences = batch_sequence_normalizers(batch, weights)
    per_token_loss = per_token_loss.detach()
    pairs = []
    if not sequences:
        # Each row is one sample (and one sequence).
        for row in range(weights.size(0)):
            numerator, denominator = token_loss_sum(
                per_token_loss[row : row + 1],
                weights[row : row + 1],
                normalization,
                constant_per_sequence=constant_per_sequence,
            )
            pairs.append(torch.stack([numerator.double(), denominator.double()]))
    else:
        sequence_weight, sequence_start = sequences["sequence_weight"], sequences["sequence_start"]
        start = sequence_start != 0
        # Sequence id of each token in row-major order (a sequence runs to the next start).
        sequence_id = start.reshape(-1).cumsum(0).view(start.shape) - 1
        for index in range(int(start.sum())):
            inside = sequence_id == index
            numerator, denominator = token_loss_sum(
                per_token_loss,
                torch.where(inside, weights, torch.zeros_like(weights)),
                normalization,
                sequence_weight=sequence_weight,
                sequence_start=start & inside,
                constant_per_sequence=constant_per_sequence,
            )
            pairs.append(torch.stack([numerator.double(), denominator.double()]))
    if not pairs:
        return torch.zeros(0, 2, dtype=torch.float64, device=weights.device)
    return torch.stack(pairs)
