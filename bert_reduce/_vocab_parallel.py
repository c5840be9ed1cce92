"""(Private) What the two masked cross-entropy kernels share: rows, shards, gradient.

:mod:`bert_reduce.cross_entropy` (logits) and :mod:`bert_reduce._fused_head` (hidden states
and the output weight) compute the same loss on the same rows; only how they obtain a chunk
of logits differs.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from bert_reduce import distributed
from bert_reduce.num_scored import NumScored, scored_count

Capacity = int | float | Literal["all", "nonzero"]
"""How many rows a masked kernel computes: ``"all"``, ``"nonzero"``, a row count or a
fraction of ``b * s``; see :mod:`bert_reduce.cross_entropy`."""


def resolve_capacity(capacity: Capacity, num_positions: int) -> int | None:
    """The static number of rows a ``capacity`` stands for, or ``None`` for ``"nonzero"``.

    A count is clipped to ``[0, num_positions]``; a fraction is one of the ``num_positions``.

    Raises:
        ValueError: On an unknown string, a negative count or a fraction outside ``(0, 1]``.
    """
    if capacity == "all":
        return num_positions
    if capacity == "nonzero":
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int | float):
        raise ValueError(
            f"capacity must be 'all', 'nonzero', a row count or a fraction in (0, 1]; "
            f"got {capacity!r}."
        )
    if isinstance(capacity, float):
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"A fractional capacity must lie in (0, 1], got {capacity}.")
        return min(num_positions, math.ceil(capacity * num_positions))
    if capacity < 0:
        raise ValueError(f"capacity must be non-negative, got {capacity}.")
    return min(num_positions, capacity)


class RowSelection(NamedTuple):
    """Which flat rows a masked loss computes.

    Attributes:
        index: int64 ``[rows]`` flat row numbers, scored rows first (each group in memory
            order), or ``None`` for every row in order.
        unselected: int64 flat rows left out (their gradient is zero), or ``None``.
        overflow: ``[positions]`` bool, true on every scored row when more rows are scored
            than selected (else all false), or ``None`` when no overflow is possible.
    """

    index: Tensor | None
    unselected: Tensor | None
    overflow: Tensor | None


def flat_rows(
    labels: Tensor,
    per_position: Tensor,
    sequence_first: bool,
    capacity: Capacity,
    num_scored: NumScored | None,
) -> tuple[Tensor, Tensor, RowSelection]:
    """Flatten ``[b, s]`` labels and mask (or weights) into the selected rows' values; no sync.

    Row ``r`` follows the memory order of the logits or hidden states: ``r = i_s * b + i_b``
    when they are sequence first (``[s, b, ...]``), ``r = i_b * s + i_s`` otherwise. A row is
    scored where ``per_position`` is non-zero. ``num_scored`` (:mod:`bert_reduce.num_scored`)
    overrides ``capacity``.

    Returns:
        ``(targets, per_row, selection)``: int64 ``[rows]`` target ids of the selected rows,
        their ``[rows]`` values of ``per_position``, and the :class:`RowSelection`.

    Raises:
        TypeError: On a ``num_scored`` that is neither an ``int`` nor an integer tensor.
        ValueError: On a bad ``capacity``, or a ``num_scored`` that sums to a negative count.
    """
    targets = labels
    if sequence_first:
        per_position, targets = per_position.transpose(0, 1), targets.transpose(0, 1)
    # Any integer label dtype; gather takes int64.
    per_position, targets = per_position.reshape(-1), targets.reshape(-1).to(torch.int64)
    scored = per_position != 0
    if num_scored is not None:
        limit: int | None = min(scored_count(num_scored), scored.numel())
    else:
        limit = resolve_capacity(capacity, scored.numel())
    if limit is not None and limit == scored.numel():
        return targets, per_position, RowSelection(None, None, None)
    # A stable sort puts the scored rows first, each group in memory order. Static shapes
    # and no host sync, unless the split point is read back ("nonzero").
    order = torch.sort(scored.to(torch.uint8), descending=True, stable=True).indices
    count = scored.sum(dtype=torch.int64)
    overflow = None
    if limit is None:
        limit = int(count)
    else:
        overflow = scored & (count > limit)
    index = order[:limit]
    return targets[index], per_position[index], RowSelection(index, order[limit:], overflow)


def tensor_parallel_placement(
    group: dist.ProcessGroup | None = None,
) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, world_size, rank)`` of the vocab-sharding group (``(None, 1, 0)`` without).

    ``group`` as the kernels' ``tp_group`` argument (``None``: Megatron-Core's, if initialized).
    """
    group = distributed.tensor_parallel_group() if group is None else group
    world_size = 1 if group is None else dist.get_world_size(group)
    if world_size == 1:
        return None, 1, 0
    return group, world_size, dist.get_rank(group)


def gather_sequence_parallel(hidden: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The whole ``[s, b, h]`` from this rank's ``[s / tp, b, h]``, as Megatron's linear does.

    Megatron-Core's own mapping (``docs/megatron.md``), on ``group`` (``None``: Megatron-Core's).
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(
        hidden, tensor_parallel_output_grad=True, group=group
    )


def vocab_start(shard: int, tp_rank: int, tp_size: int) -> int:
    """First vocab id of this rank's contiguous shard.

    Megatron-Core's rule (``VocabUtility.vocab_range_from_per_partition_vocab_size``):
    ``[rank * shard, (rank + 1) * shard)``; written out so that an explicit ``tp_group`` needs
    no Megatron. ``tests/test_cross_entropy.py`` checks it against Megatron's own.
    """
    return tp_rank * shard if tp_size > 1 else 0


class ShardedTargets(NamedTuple):
    """Where each row's target falls in this rank's vocab shard.

    Attributes:
        local: int64 ``[rows, 1]`` target id within the shard (0 where not in it).
        in_shard: ``[rows]`` bool, whether the target lies in this rank's shard.
        in_vocab: ``[rows]`` bool, whether the target lies in the whole vocabulary.
    """

    local: Tensor
    in_shard: Tensor
    in_vocab: Tensor


def shard_targets(
    targets: Tensor, shard: int, tp_group: dist.ProcessGroup | None = None
) -> ShardedTargets:
    """Locate ``[rows]`` target ids in this rank's vocab shard of size ``shard``."""
    _, tp_size, tp_rank = tensor_parallel_placement(tp_group)
    local = targets - vocab_start(shard, tp_rank, tp_size)
    in_shard = (local >= 0) & (local < shard)
    in_vocab = (targets >= 0) & (targets < shard * tp_size)
    return ShardedTargets(torch.where(in_shard, local, 0).unsqueeze(1), in_shard, in_vocab)


def combine_shard_stats(
    stats: Tensor, targets: ShardedTargets, tp_group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor]:
    """``(lse, target_logit)``, ``[rows]`` each, over the whole vocabulary: ONE collective.

    ``stats`` is a zeroed ``[tp, 2, rows]`` buffer with this rank's slot filled in: the log-sum-exp
    over the vocabulary is the log-sum-exp of the shards', the target's logit its shard's.
    """
    group, _, tp_rank = tensor_parallel_placement(tp_group)
    # Only the shard holding the target contributes its logit; every other slot stays 0 so
    # that a single SUM all-reduce fills in every shard's.
    stats[tp_rank, 1] = torch.where(targets.in_shard, stats[tp_rank, 1], 0)
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    return torch.logsumexp(stats[:, 0], dim=0), stats[:, 1].sum(dim=0)


def row_losses(lse: Tensor, target_logit: Tensor, in_vocab: Tensor) -> Tensor:
    """``[rows]`` cross-entropy ``lse - target_logit``, NaN where the target is not in the vocab."""
    return torch.where(in_vocab, lse - target_logit, torch.nan)


def scatter_losses(
    loss: Tensor, scored: Tensor, selection: RowSelection, positions: int
) -> tuple[Tensor, Tensor]:
    """``[positions]`` losses from the ``[rows]`` ``loss`` of ``selection``'s rows.

    Returns ``(losses, scored)``: ``loss`` where the ``[rows]`` bool ``scored`` holds, 0
    elsewhere, NaN on every scored row after a capacity overflow; and the rows whose gradient
    is not zero (none after an overflow, whose gradient is NaN instead).
    """
    # `where`, not a product: whatever an unscored row holds must not reach the output.
    loss = torch.where(scored, loss, 0)
    if selection.index is None:
        losses = loss
    else:
        losses = loss.new_zeros(positions).index_copy_(0, selection.index, loss)
    if selection.overflow is not None:
        # Scored rows past the capacity have no loss: poison every scored row instead.
        losses = torch.where(selection.overflow, torch.nan, losses)
        scored = scored & ~selection.overflow.any()
    return losses, scored


def row_coefficients(
    grad_positions: Tensor,
    dtype: torch.dtype,
    index: Tensor | None,
    scored: Tensor,
    overflow: Tensor | None,
) -> Tensor:
    """``[rows]`` upstream gradient of each selected row's loss: the backward's coefficient.

    From the ``[positions]`` gradient of the per-position losses, in ``dtype``: 0 on unscored
    rows (their loss was 0, not a function of the logits), NaN everywhere after an ``overflow``.
    """
    coef = grad_positions.to(dtype)
    if index is not None:
        coef = coef[index]
    coef = torch.where(scored, coef, 0)
    if overflow is not None:
        coef = torch.where(overflow.any(), torch.nan, coef)
    return coef


def logsumexp_(x: Tensor) -> Tensor:
    """``x.logsumexp(dim=-1)`` for a ``[c, v]`` buffer it may overwrite: no temporary."""
    shift = x.amax(dim=-1, keepdim=True)
    # A row of -inf (or +inf) keeps logsumexp's answer instead of inf - inf = NaN.
    shift = torch.where(shift.isfinite(), shift, 0)
    return x.sub_(shift).exp_().sum(dim=-1).log_().add_(shift.squeeze(-1))
