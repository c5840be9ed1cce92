"""Masked cross-entropy that computes only what the loss mask needs.

An MLM loss scores ~15% of the positions, yet a dense cross-entropy (``F.cross_entropy``,
Megatron-Core's ``vocab_parallel_cross_entropy``) normalizes every row of the ``[s, b, v]``
logits, keeps full-size fp32 softmax buffers alive for backward, and masks afterwards.
:func:`masked_cross_entropy` instead

* reads only the rows it has to score, in chunks (by default 1/32 of the logits' bytes once
  in fp32, at least 2**20 values: few large kernels, little extra memory), in fp32
  (fp64 for fp64 logits), and keeps no more than one ``[rows]`` log-sum-exp for backward;
* writes the gradient of the selected rows only: every other row of the gradient is zero, so the
  only full-size allocation is the gradient itself (or nothing, with ``in_place=True``);
* under tensor parallelism (vocab-sharded logits) runs exactly one collective: each rank's
  per-row ``(log-sum-exp, target logit)`` goes into its slot of a ``[tp, 2, rows]`` buffer that
  one all-reduce completes; the global log-sum-exp is the log-sum-exp of the shards'.

Which rows are computed (``capacity``) is the one trade-off, because on an accelerator a
data-dependent number of rows needs a device-to-host sync:

* ``"all"`` (default): every position is computed; unmasked ones get weight 0. Static shapes,
  exact for any mask, no sync. Saves memory, not arithmetic.
* an ``int`` (rows) or a ``float`` in ``(0, 1]`` (fraction of ``b * s``, rounded up): a static
  capacity. The masked positions are moved to the front by a stable sort of the mask (no sync)
  and the first ``capacity`` rows are computed. Exact whenever at most ``capacity`` positions
  are masked; otherwise the loss **and** the gradient are NaN (checked on the device, no sync),
  so an overflow can never pass silently (Megatron's NaN checks stop the step). With Bernoulli
  masking at rate ``p`` over ``n`` positions, choose ``capacity >= n * p + 6 * sqrt(n * p *
  (1 - p))``, e.g. ``0.2`` for ``p = 0.15`` and ``n >= 2000``.
* ``"nonzero"``: exactly the rows where the mask is non-zero: exact for any mask and minimal
  work, at the price of one host sync per call on an accelerator (their number is read back,
  as ``nonzero`` would).

This module is pure torch; Megatron-Core is only consulted (through
:mod:`bert_reduce.distributed`) when its parallel state is initialized.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from bert_reduce import distributed
from bert_reduce.functional import (
    accumulation_dtype,
    check_logits_and_labels,
    check_same_device,
    check_same_shape,
    masked_loss_sum,
)

__all__ = [
    "Capacity",
    "NumScored",
    "RowSelection",
    "ShardedTargets",
    "combine_shard_stats",
    "masked_cross_entropy",
    "masked_token_losses",
    "resolve_capacity",
    "scatter_row_losses",
    "scored_count",
    "select_rows",
    "shard_stats",
    "shard_targets",
]

Capacity = int | float | Literal["all", "nonzero"]
"""How many rows :func:`masked_cross_entropy` computes; see the module docstring."""

_MIN_CHUNK_ELEMENTS = 1 << 20
_CHUNKS_PER_LOGITS = 32


def _default_chunk_elements(logits: Tensor, acc: torch.dtype) -> int:
    """Chunks whose fp32 copy is 1/32 of the logits' bytes, and never tiny."""
    per_chunk = logits.numel() * logits.element_size() // (_CHUNKS_PER_LOGITS * acc.itemsize)
    return max(_MIN_CHUNK_ELEMENTS, per_chunk)


def resolve_capacity(capacity: Capacity, num_positions: int) -> int | None:
    """The static number of rows a ``capacity`` stands for, or ``None`` for ``"nonzero"``.

    Args:
        capacity: ``"all"``, ``"nonzero"``, a row count, or a fraction of the positions.
        num_positions: ``b * s``, the number of positions in the micro-batch.

    Returns:
        The row count, clipped to ``[0, num_positions]``, or ``None`` for ``"nonzero"``.

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


NumScored = int | tuple[int, ...] | list[int] | Tensor
"""The data pipeline's count of scored positions: a Python ``int``, a tuple (or list) of
per-sample ints to sum, or an integer tensor of counts to sum (e.g. a ``[b]`` per-sample
tensor). Ints and CPU tensors are host data, read with no device sync; a tensor on an
accelerator is read once (one sync). See :mod:`bert_reduce.num_scored`."""


def scored_count(num_scored: NumScored) -> int:
    """The number of scored positions ``num_scored`` stands for, as a Python ``int``.

    Raises:
        TypeError: If ``num_scored`` is neither an ``int``, a tuple of ints nor an integer
            tensor.
        ValueError: If it counts fewer than zero positions.
    """
    if isinstance(num_scored, Tensor) and not num_scored.dtype.is_floating_point:
        if num_scored.device.type == "cpu":
            # Host memory, read through numpy: no device involved.
            count = int(num_scored.numpy().sum())
        else:
            # The price of a count left on the accelerator: one device-to-host sync.
            count = int(num_scored.sum())
    elif isinstance(num_scored, int) and not isinstance(num_scored, bool):
        count = num_scored
    elif isinstance(num_scored, tuple | list) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in num_scored
    ):
        count = sum(num_scored)
    else:
        raise TypeError(
            "num_scored must be a Python int, a tuple of ints or an integer tensor of counts, got "
            f"{num_scored.dtype if isinstance(num_scored, Tensor) else type(num_scored).__name__}."
        )
    if count < 0:
        raise ValueError(f"num_scored must be non-negative, got a sum of {count}.")
    return count


def select_rows(
    scored: Tensor, capacity: Capacity = "all", num_scored: NumScored | None = None
) -> RowSelection:
    """Choose the rows to compute from the flat ``[positions]`` bool ``scored``, without a sync.

    Args:
        scored: ``[positions]`` bool, true where the loss mask is non-zero.
        capacity: See :func:`resolve_capacity`; ignored when ``num_scored`` is given.
        num_scored: The number of scored positions as the data pipeline counted them
            (:data:`NumScored`: an ``int``, or an integer tensor whose sum is the count; on
            the host it costs no device sync). Used as an exact static capacity: more scored
            rows than it says make the loss NaN (checked on the device), fewer only cost
            unscored rows of work.

    Returns:
        The selection; ``index`` is ``None`` when every row is computed.

    Raises:
        TypeError: On a ``num_scored`` that is neither an ``int`` nor an integer tensor.
        ValueError: On a bad ``capacity``, or a ``num_scored`` that sums to a negative count.
    """
    if num_scored is not None:
        limit: int | None = min(scored_count(num_scored), scored.numel())
    else:
        limit = resolve_capacity(capacity, scored.numel())
    if limit is not None and limit == scored.numel():
        return RowSelection(None, None, None)
    # A stable sort puts the scored rows first, each group in memory order. Static shapes
    # and no host sync, unless the split point is read back ("nonzero").
    order = torch.sort(scored.to(torch.uint8), descending=True, stable=True).indices
    count = scored.sum(dtype=torch.int64)
    overflow = None
    if limit is None:
        limit = int(count)
    else:
        overflow = scored & (count > limit)
    return RowSelection(order[:limit], order[limit:], overflow)


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
    """Locate ``[rows]`` target ids in this rank's vocab shard of size ``shard``.

    ``tp_group``: the vocab-sharding group; see :func:`masked_token_losses`.
    """
    _, tp_size, tp_rank = tensor_parallel_placement(tp_group)
    local = targets - vocab_start(shard, tp_rank, tp_size)
    in_shard = (local >= 0) & (local < shard)
    in_vocab = (targets >= 0) & (targets < shard * tp_size)
    return ShardedTargets(torch.where(in_shard, local, 0).unsqueeze(1), in_shard, in_vocab)


def shard_stats(
    rows: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The zeroed ``[tp, 2, rows]`` buffer :func:`combine_shard_stats` reduces.

    This rank fills its slot, ``stats[tp_rank]``, with its shard's per-row (log-sum-exp,
    target logit) and leaves the other slots at zero.
    """
    _, tp_size, _ = tensor_parallel_placement(tp_group)
    return torch.zeros(tp_size, 2, rows, dtype=dtype, device=device)


def combine_shard_stats(
    stats: Tensor, targets: ShardedTargets, tp_group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor]:
    """The global per-row log-sum-exp and target logit, in ONE collective under TP.

    Args:
        stats: ``[tp, 2, rows]`` from :func:`shard_stats`, this rank's slot filled in.
        targets: This rank's :func:`shard_targets`.
        tp_group: The vocab-sharding group (see :func:`masked_token_losses`).

    Returns:
        ``(lse, target_logit)``, each ``[rows]``: the log-sum-exp over the whole vocabulary
        (the log-sum-exp of the shards') and the target's logit (from the shard holding it).
    """
    group, _, tp_rank = tensor_parallel_placement(tp_group)
    # Only the shard holding the target contributes its logit; every other slot stays 0 so
    # that a single SUM all-reduce fills in every shard's.
    stats[tp_rank, 1] = torch.where(targets.in_shard, stats[tp_rank, 1], 0)
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    return torch.logsumexp(stats[:, 0], dim=0), stats[:, 1].sum(dim=0)


def scatter_row_losses(
    lse: Tensor,
    target_logit: Tensor,
    targets: ShardedTargets,
    scored: Tensor,
    selection: RowSelection,
    positions: int,
) -> tuple[Tensor, Tensor]:
    """Per-position losses from the selected rows' statistics.

    Args:
        lse: ``[rows]`` global log-sum-exp of the selected rows.
        target_logit: ``[rows]`` their target logits.
        targets: Their :class:`ShardedTargets`.
        scored: ``[rows]`` bool, whether each selected row is scored.
        selection: The :class:`RowSelection` the rows come from.
        positions: Number of flat positions (``b * s``).

    Returns:
        ``(losses, scored)``: ``[positions]`` losses (``lse - target_logit`` on scored rows,
        NaN for a target outside the vocabulary, 0 elsewhere, NaN on every scored row after a
        capacity overflow), and the ``[rows]`` rows whose gradient is not zero (none after
        an overflow, whose gradient is NaN instead).
    """
    loss = torch.where(targets.in_vocab, lse - target_logit, torch.nan)
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


def tensor_parallel_placement(
    group: dist.ProcessGroup | None = None,
) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, world_size, rank)`` of the vocab-sharding group (``(None, 1, 0)`` without).

    ``group`` when given, else Megatron-Core's tensor-parallel group when its parallel state is
    initialized, else none.
    """
    if group is None:
        if distributed.tensor_parallel_world_size() == 1:
            return None, 1, 0
        group = distributed.tensor_parallel_group()
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None, 1, 0
    return group, world_size, dist.get_rank(group)


def vocab_start(shard: int, tp_rank: int, tp_size: int) -> int:
    """First vocab id of this rank's contiguous shard.

    Megatron-Core's rule (``VocabUtility.vocab_range_from_per_partition_vocab_size``):
    ``[rank * shard, (rank + 1) * shard)``; written out so that an explicit ``tp_group`` needs
    no Megatron. ``tests/test_cross_entropy.py`` checks it against Megatron's own.
    """
    return tp_rank * shard if tp_size > 1 else 0


class _Rows:
    """Reads and writes rows ``r = i_s * b + i_b`` of ``[s, b, v]`` tensors, by chunk.

    ``index`` is ``None`` for "every row, in order" (chunks are then slices, views when the
    tensor is contiguous), else an int64 ``[rows]`` tensor of flat row numbers.
    """

    def __init__(self, shape: torch.Size, index: Tensor | None, chunk_elements: int) -> None:
        self.seq_len, self.batch_size, self.vocab = shape
        self.index = index
        self.count = self.seq_len * self.batch_size if index is None else index.numel()
        self.chunk = max(1, chunk_elements // max(1, self.vocab))

    def chunks(self) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk, self.count)) for a in range(0, self.count, self.chunk)]

    def _rows(self, start: int, end: int, device: torch.device) -> Tensor:
        if self.index is None:
            return torch.arange(start, end, device=device)
        return self.index[start:end]

    def _coordinates(self, start: int, end: int, device: torch.device) -> tuple[Tensor, Tensor]:
        rows = self._rows(start, end, device)
        return rows.div(self.batch_size, rounding_mode="floor"), rows.remainder(self.batch_size)

    def read(self, tensor: Tensor, start: int, end: int) -> Tensor:
        """Rows ``[start, end)`` as a ``[c, v]`` tensor: a view when possible, else a copy."""
        if not tensor.is_contiguous():
            return tensor[self._coordinates(start, end, tensor.device)]
        flat = tensor.view(-1, self.vocab)
        if self.index is None:
            return flat[start:end]
        return flat.index_select(0, self.index[start:end])

    def read_as(self, tensor: Tensor, start: int, end: int, dtype: torch.dtype) -> Tensor:
        """Rows ``[start, end)`` in ``dtype``: a private copy unless :meth:`is_view` says so."""
        return self.read(tensor, start, end).to(dtype)

    def is_view(self, tensor: Tensor, dtype: torch.dtype) -> bool:
        """Whether :meth:`read_as` returns a view of ``tensor`` (else a copy it may overwrite)."""
        return self.index is None and tensor.is_contiguous() and tensor.dtype == dtype

    def write(self, tensor: Tensor, start: int, end: int, values: Tensor) -> None:
        """Store ``values`` (``[c, v]``) into rows ``[start, end)`` of ``tensor``."""
        values = values.to(tensor.dtype)
        if not tensor.is_contiguous():
            tensor.index_put_(self._coordinates(start, end, tensor.device), values)
        elif self.index is None:
            tensor.view(-1, self.vocab)[start:end].copy_(values)
        else:
            tensor.view(-1, self.vocab).index_copy_(0, self.index[start:end], values)

    def zero(self, tensor: Tensor, rows: Tensor) -> None:
        """Zero the given flat rows of ``tensor``, touching no other row."""
        if tensor.is_contiguous():
            tensor.view(-1, self.vocab).index_fill_(0, rows, 0)
        else:
            where = (rows.div(self.batch_size, rounding_mode="floor"), rows % self.batch_size)
            tensor.index_put_(where, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


def logsumexp_(x: Tensor) -> Tensor:
    """``x.logsumexp(dim=-1)`` for a ``[c, v]`` buffer it may overwrite: no temporary."""
    shift = x.amax(dim=-1, keepdim=True)
    # A row of -inf (or +inf) keeps logsumexp's answer instead of inf - inf = NaN.
    shift = torch.where(shift.isfinite(), shift, 0)
    return x.sub_(shift).exp_().sum(dim=-1).log_().add_(shift.squeeze(-1))


class _MaskedTokenLosses(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        scored: Tensor,
        rows: _Rows,
        unselected: Tensor | None,
        overflow: Tensor | None,
        in_place: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        """``[b, s]`` losses of the selected rows, 0 elsewhere (see :func:`masked_token_losses`).

        ``targets`` and ``scored`` are ``[rows]``, aligned with ``rows``; a selected row that is
        not scored gets loss 0 and no gradient. ``unselected`` (int64) lists the flat rows
        whose gradient is zero without being computed. ``overflow`` (``[s * b]`` bool) is
        true on every scored row when more rows are scored than selected, else all false.
        """
        _, _, tp_rank = tensor_parallel_placement(tp_group)
        acc = accumulation_dtype(logits.dtype)
        seq_len, batch_size, shard = logits.shape
        sharded = shard_targets(targets, shard, tp_group)
        stats = shard_stats(rows.count, acc, logits.device, tp_group)
        private = not rows.is_view(logits, acc)
        for start, end in rows.chunks():
            x = rows.read_as(logits, start, end, acc)
            stats[tp_rank, 1, start:end] = x.gather(1, sharded.local[start:end]).squeeze(1)
            stats[tp_rank, 0, start:end] = logsumexp_(x) if private else x.logsumexp(dim=-1)
        lse, target_logit = combine_shard_stats(stats, sharded, tp_group)
        selection = RowSelection(rows.index, unselected, overflow)
        losses, scored = scatter_row_losses(
            lse, target_logit, sharded, scored, selection, seq_len * batch_size
        )
        local, in_shard = sharded.local, sharded.in_shard
        ctx.rows, ctx.in_place = rows, in_place
        ctx.save_for_backward(logits, lse, local, in_shard, scored, unselected, overflow)
        return losses.view(seq_len, batch_size).t().contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor | None, ...]:
        logits, lse, local, in_shard, scored, unselected, overflow = ctx.saved_tensors
        rows: _Rows = ctx.rows
        acc = lse.dtype
        coef = grad_losses.t().reshape(-1).to(acc)
        if rows.index is not None:
            coef = coef[rows.index]
        coef = torch.where(scored, coef, 0)
        if overflow is not None:
            coef = torch.where(overflow.any(), torch.nan, coef)
        coef = coef.unsqueeze(1)
        hit = -in_shard.to(acc).unsqueeze(1)
        grad = (
            logits
            if ctx.in_place
            else torch.empty_like(logits, memory_format=torch.contiguous_format)
        )
        # Compute straight into the gradient's own rows when they are a view of the right
        # dtype, else into the chunk's private copy of the logits, else into a new buffer.
        direct = rows.is_view(grad, acc)
        private = not rows.is_view(logits, acc)
        for start, end in rows.chunks():
            x = rows.read_as(logits, start, end, acc)
            out = rows.read(grad, start, end) if direct else x if private else None
            p = torch.sub(x, lse[start:end].unsqueeze(1), out=out)
            p.exp_()
            p.scatter_add_(1, local[start:end], hit[start:end])
            p.mul_(coef[start:end])
            if not direct:
                rows.write(grad, start, end, p)
        if unselected is not None:
            rows.zero(grad, unselected)
        return grad, None, None, None, None, None, None, None


def masked_token_losses(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    *,
    capacity: Capacity = "all",
    in_place: bool = False,
    chunk_elements: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    num_scored: NumScored | None = None,
) -> Tensor:
    """Per-token cross-entropy on the scored positions, computing only what the mask needs.

    Where ``loss_mask`` is non-zero this equals (up to rounding)
    ``F.cross_entropy(logits, labels, reduction="none")`` and so does its gradient; elsewhere
    the loss is 0 and carries no gradient, whatever the label. A ``[b, s]`` output lets any
    weighting or normalization (:mod:`bert_reduce.normalization`) follow, while the caller's
    logits are never copied whole, never modified (unless ``in_place``), and no
    row outside the selection is normalized. See the module docstring for ``capacity``.

    ``in_place=True`` writes the gradient into the logits' own storage during backward, so the
    gradient costs no memory at all. That is only safe when nothing reads the logits after the
    loss: they must be a non-leaf tensor (e.g. the output projection's result) consumed by this
    loss alone, with no other reference read after backward (no detached copy in a report or
    a metric, no ``retain_graph``). Under tensor parallelism it applies to this rank's shard.

    Args:
        logits: ``[s, b, v]`` logits, any float dtype; under tensor parallelism ``v`` is this
            rank's contiguous vocab shard (Megatron-Core's ``VocabUtility`` layout: rank ``r``
            holds ids ``[r * v, (r + 1) * v)``).
        labels: ``[b, s]`` integer token ids; unscored positions may hold anything (``-100``).
        loss_mask: ``[b, s]`` bool, integer or float; non-zero entries are scored.
        capacity: ``"all"`` (default), ``"nonzero"``, a row count or a fraction of ``b * s``.
        in_place: Write the gradient into ``logits`` (see above).
        chunk_elements: About how many logits one chunk reads at a time: trades the extra
            memory (a few fp32 chunks) against per-chunk overhead (kernel launches, thread
            barriers). ``None``: 1/32 of the logits' bytes in fp32, at least 2**20 values.
        tp_group: The group the vocabulary is sharded over (its one all-reduce runs there);
            ``None``: Megatron-Core's tensor-parallel group when its parallel state is
            initialized, else no sharding.
        num_scored: The data pipeline's count of scored positions (:data:`NumScored`: an
            ``int``, or e.g. the collator's per-sample ``[b]`` counts): computes exactly that
            many rows, with no host sync when it is on the host; overrides ``capacity``. See
            :func:`select_rows`.

    Returns:
        ``[b, s]`` losses in fp32 (fp64 for fp64 logits): NaN where a scored label is outside
        the vocabulary, and on every scored position when more positions are scored than a
        static ``capacity`` holds (the gradient is then NaN too).

    Raises:
        ValueError: On mismatched shapes, a bad ``capacity`` or ``chunk_elements``, or
            ``in_place`` on a leaf tensor that requires grad.
    """
    check_logits_and_labels(logits, labels)
    check_same_shape(loss_mask, labels, ("loss_mask", "labels"), "[b, s]")
    check_same_device(loss_mask, labels, ("loss_mask", "labels"))
    if chunk_elements is None:
        chunk_elements = _default_chunk_elements(logits, accumulation_dtype(logits.dtype))
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}.")
    if in_place and logits.requires_grad and logits.is_leaf:
        raise ValueError(
            "in_place=True would write the gradient into a leaf tensor's data; pass the "
            "non-leaf logits of the model instead."
        )
    # Flat row r = i_s * b + i_b follows the [s, b, v] memory order of the logits.
    scored = (loss_mask != 0).transpose(0, 1).reshape(-1)
    targets = labels.transpose(0, 1).reshape(-1).to(torch.int64)  # gather takes int64

    selection = select_rows(scored, capacity, num_scored)
    index, unselected, overflow = selection.index, selection.unselected, selection.overflow
    if index is not None:
        targets, scored = targets[index], scored[index]
    rows = _Rows(logits.shape, index, chunk_elements)
    return _MaskedTokenLosses.apply(
        logits, targets, scored, rows, unselected, overflow, in_place, tp_group
    )


def masked_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    *,
    capacity: Capacity = "all",
    in_place: bool = False,
    chunk_elements: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    num_scored: NumScored | None = None,
) -> tuple[Tensor, Tensor]:
    """Cross-entropy summed over the scored tokens, and its denominator.

    :func:`masked_token_losses` followed by :func:`bert_reduce.functional.masked_loss_sum`:
    equal (up to rounding) to ``sum(w * F.cross_entropy(logits[mask], labels[mask],
    reduction="none"))`` with its gradient, for a bool, integer or float (weighting)
    ``loss_mask``, and the mask's :func:`bert_reduce.functional.token_denominator`.

    Args:
        logits: ``[s, b, v]`` logits, vocab-sharded under tensor parallelism.
        labels: ``[b, s]`` integer token ids.
        loss_mask: ``[b, s]``; non-zero where scored, float entries weight the loss.
        capacity: Which rows are computed; see :func:`masked_token_losses`.
        in_place: Write the gradient into ``logits``; see :func:`masked_token_losses`.
        chunk_elements: About how many logits one chunk reads at a time (``None``: adaptive).
        tp_group: The vocab-sharding group; see :func:`masked_token_losses`.
        num_scored: The data pipeline's count of scored positions; see
            :func:`masked_token_losses`.

    Returns:
        ``(loss_sum, denominator)``: a 0-dim ``sum(w * loss)`` in fp32 (fp64 for fp64 logits)
        carrying the gradient, NaN on an out-of-vocabulary scored label or a capacity
        overflow; and the 0-dim denominator (int64 token count, or fp64 sum of float weights).

    Raises:
        ValueError: As :func:`masked_token_losses`.
    """
    losses = masked_token_losses(
        logits,
        labels,
        loss_mask,
        capacity=capacity,
        in_place=in_place,
        chunk_elements=chunk_elements,
        tp_group=tp_group,
        num_scored=num_scored,
    )
    return masked_loss_sum(losses, loss_mask)
