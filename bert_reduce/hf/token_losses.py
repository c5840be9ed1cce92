"""What :class:`~bert_reduce.hf.ExactMLMTrainer` adds to the engine for a Hugging Face batch.

* :func:`split_model_inputs`: the batch's keys the model takes, without the loss's;
* :func:`sample_loss_terms`: a batch's ``(numerator, denominator)`` per sample (a row, or a
  packed sequence), for evaluation sets whose padding duplicates are dropped sample by sample.

The losses themselves come from :mod:`bert_reduce.engine`, as for every integration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from bert_reduce.engine import LossOptions
from bert_reduce.normalization import token_loss_sum
from bert_reduce.packing import batch_sequence_normalizers

__all__ = ["LOSS_ONLY_KEYS", "sample_loss_terms", "split_model_inputs"]

LOSS_ONLY_KEYS = ("labels", "loss_mask", "sequence_weight", "sequence_start", "num_scored")
"""Batch keys the loss reads and the model is not given. ``labels`` is kept from the model
so that it computes no loss of its own (and ``[b, s, v]`` logits are not scored twice)."""


def split_model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch without :data:`LOSS_ONLY_KEYS`: what the model's ``forward`` receives.

    Packing keys (``position_ids``, ``cu_seq_lens_q``, ...) stay: the model's attention needs
    them, and the loss reads them from the batch as well.
    """
    return {key: value for key, value in batch.items() if key not in LOSS_ONLY_KEYS}


def sample_loss_terms(
    batch: Mapping[str, Any], weights: Tensor, per_token_loss: Tensor, options: LossOptions
) -> Tensor:
    """``[n, 2]`` fp64 ``(numerator, denominator)`` of each of a batch's ``n`` samples.

    Their sum over samples is the batch's :func:`bert_reduce.engine.mode_terms`. A sample is a
    row of a ``[b, s]`` batch, or a sequence of a packed one (in order): the unit a distributed
    evaluation sampler pads with duplicates and ``accelerate``'s ``gather_for_metrics`` drops
    again.
    Reads the number of packed sequences on the host (an evaluation-time sync).

    Args:
        batch: The batch; its sequences as
            :func:`bert_reduce.packing.batch_sequence_normalizers` finds them.
        weights: ``[b, s]`` :func:`bert_reduce.engine.scored_weights`.
        per_token_loss: ``[b, s]`` losses.
        options: The loss options (their mode, constant and weight resolution).

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
                options.normalization,
                constant_per_sequence=options.constant_per_sequence,
                weight_resolution=options.weight_resolution,
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
                options.normalization,
                sequence_weight=sequence_weight,
                sequence_start=start & inside,
                constant_per_sequence=options.constant_per_sequence,
                weight_resolution=options.weight_resolution,
            )
            pairs.append(torch.stack([numerator.double(), denominator.double()]))
    if not pairs:
        return torch.zeros(0, 2, dtype=torch.float64, device=weights.device)
    return torch.stack(pairs)
