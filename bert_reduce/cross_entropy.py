"""Cross-entropy on ``[s, b, v]`` logits that computes only what the loss mask needs.

An MLM loss scores ~15% of the positions, yet a dense cross-entropy (``F.cross_entropy``,
Megatron-Core's ``vocab_parallel_cross_entropy``) normalizes every row of the ``[s, b, v]``
logits, keeps full-size fp32 softmax buffers alive for backward, and masks afterwards.
:func:`cross_entropy_token_losses` (``[b, s]`` losses) and :func:`cross_entropy_loss_sum`
(their ``(loss_sum, denominator)``) instead

* read only the rows they have to score, in chunks (by default 1/32 of the logits' bytes
  once in fp32, at least 2**20 values: few large kernels, little extra memory), in fp32
  (fp64 for fp64 logits), with PyTorch's fused ``log_softmax`` and ``softmax`` kernels, and
  keep no more than a ``[rows]`` vector for backward;
* write the gradient of the selected rows only: every other row of the gradient is zero, so
  the only full-size allocation is the gradient itself (or nothing, with ``in_place=True``);
* under tensor parallelism (vocab-sharded logits) run exactly one collective: each rank's
  per-row ``(log-sum-exp, target logit)`` goes into its slot of a ``[tp, 2, rows]`` buffer that
  one all-reduce completes; the global log-sum-exp is the log-sum-exp of the shards'.

Which rows are computed (``capacity``: ``"all"`` by default, exact and sync-free; a static
row count or fraction; ``"nonzero"``, one host sync; or the batch's ``num_scored``) is the one
trade-off, written up in ``docs/fast_path.md``.

The row selection and the shard statistics are shared with the fused head
(:mod:`bert_reduce.linear_cross_entropy`) in :mod:`bert_reduce._vocab_parallel`.
:func:`unreduced_token_loss_fn` is BioNeMo's name for the per-token loss on every position
(Megatron-Core's kernel when its parallel state is initialized), for code ported from it
(see ``docs/bionemo.md``). This module is pure torch; Megatron-Core is only consulted
(through :mod:`bert_reduce.distributed`) when its parallel state is initialized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from bert_reduce import _vocab_parallel as vp
from bert_reduce import distributed
from bert_reduce._vocab_parallel import Capacity
from bert_reduce.functional import (
    accumulation_dtype,
    check_logits_and_labels,
    check_same_device,
    check_same_shape,
)
from bert_reduce.normalization import Normalization, token_loss_sum

if TYPE_CHECKING:
    from bert_reduce.num_scored import NumScored

__all__ = [
    "Capacity",
    "cross_entropy_loss_sum",
    "cross_entropy_token_losses",
    "unreduced_token_loss_fn",
]

_MIN_CHUNK_ELEMENTS = 1 << 20
_CHUNKS_PER_LOGITS = 32


def _default_chunk_elements(logits: Tensor, acc: torch.dtype) -> int:
    """Chunks whose fp32 copy is 1/32 of the logits' bytes, and never tiny."""
    per_chunk = logits.numel() * logits.element_size() // (_CHUNKS_PER_LOGITS * acc.itemsize)
    return max(_MIN_CHUNK_ELEMENTS, per_chunk)


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

    def scratch(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A ``[chunk, v]`` buffer for one call's chunks: allocated once, not once per chunk.

        One chunk-sized allocation per call keeps the allocator (and, on the CPU, the kernel's
        page faults on fresh memory) out of the loop.
        """
        return torch.empty(min(self.chunk, self.count), self.vocab, dtype=dtype, device=device)

    def read_into(self, tensor: Tensor, start: int, end: int, scratch: Tensor) -> Tensor:
        """Rows ``[start, end)`` copied into ``scratch``'s first rows (converted to its dtype)."""
        out = scratch[: end - start]
        if self.index is not None and tensor.is_contiguous() and tensor.dtype == out.dtype:
            # Gathered straight into the buffer: one copy, not a gather and then a copy.
            flat = tensor.view(-1, self.vocab)
            return torch.index_select(flat, 0, self.index[start:end], out=out)
        return out.copy_(self.read(tensor, start, end))

    def is_view(self, tensor: Tensor, dtype: torch.dtype) -> bool:
        """Whether rows of ``tensor`` are views of it in ``dtype`` (else they need a copy)."""
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


def _softmax(x: Tensor, out: Tensor) -> Tensor:
    """``softmax(x, dim=-1)`` written into ``out`` (which may be ``x`` itself)."""
    return torch.softmax(x, -1, out=out)


def _log_softmax(x: Tensor, out: Tensor) -> Tensor:
    """``log_softmax(x, dim=-1)`` written into ``out`` (which may be ``x`` itself)."""
    return torch.log_softmax(x, -1, out=out)


class _CrossEntropyTokenLosses(torch.autograd.Function):
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
        """``[b, s]`` losses of the selected rows, 0 elsewhere (:func:`cross_entropy_token_losses`).

        ``targets`` and ``scored`` are ``[rows]``, aligned with ``rows``; a selected row that is
        not scored gets loss 0 and no gradient. ``unselected`` (int64) lists the flat rows
        whose gradient is zero without being computed. ``overflow`` (``[s * b]`` bool) is
        true on every scored row when more rows are scored than selected, else all false.
        """
        _, tp_size, tp_rank = vp.tensor_parallel_placement(tp_group)
        acc = accumulation_dtype(logits.dtype)
        seq_len, batch_size, shard = logits.shape
        sharded = vp.shard_targets(targets, shard, tp_group)
        view = rows.is_view(logits, acc)
        scratch = rows.scratch(acc, logits.device)
        shard_share = None
        if tp_size == 1:
            # One shard: loss = -log_softmax(x)[target], with PyTorch's fused kernel.
            loss = torch.empty(rows.count, dtype=acc, device=logits.device)
            for start, end in rows.chunks():
                if view:
                    x = rows.read(logits, start, end)
                    log_probs = _log_softmax(x, scratch[: end - start])
                else:
                    x = rows.read_into(logits, start, end, scratch)
                    log_probs = _log_softmax(x, x)
                loss[start:end] = log_probs.gather(1, sharded.local[start:end]).squeeze(1).neg_()
            loss = torch.where(sharded.in_vocab, loss, torch.nan)
        else:
            stats = vp.shard_stats(rows.count, acc, logits.device, tp_group)
            for start, end in rows.chunks():
                x = rows.read_into(logits, start, end, scratch)
                stats[tp_rank, 1, start:end] = x.gather(1, sharded.local[start:end]).squeeze(1)
                stats[tp_rank, 0, start:end] = vp.logsumexp_(x)
            shard_lse = stats[tp_rank, 0].clone()
            lse, target_logit = vp.combine_shard_stats(stats, sharded, tp_group)
            loss = vp.row_losses(lse, target_logit, sharded.in_vocab)
            # softmax over the vocabulary = this shard's softmax * exp(lse_shard - lse).
            shard_share = torch.exp(shard_lse - lse)
        selection = vp.RowSelection(rows.index, unselected, overflow)
        losses, scored = vp.scatter_losses(loss, scored, selection, seq_len * batch_size)
        ctx.rows, ctx.in_place = rows, in_place
        ctx.save_for_backward(
            logits, sharded.local, sharded.in_shard, scored, unselected, overflow, shard_share
        )
        return losses.view(seq_len, batch_size).t().contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor | None, ...]:
        logits, local, in_shard, scored, unselected, overflow, shard_share = ctx.saved_tensors
        rows: _Rows = ctx.rows
        acc = accumulation_dtype(logits.dtype)
        coef = vp.row_coefficients(grad_losses.t().reshape(-1), acc, rows.index, scored, overflow)
        scale = coef if shard_share is None else coef * shard_share
        target_weight = torch.where(in_shard, coef, 0)
        grad = (
            logits
            if ctx.in_place
            else torch.empty_like(logits, memory_format=torch.contiguous_format)
        )
        # Compute straight into the gradient's own rows when they are a view of the right
        # dtype, else into the chunk's copy of the logits (which then exists: the rows are
        # selected, or of another dtype), written into the gradient afterwards.
        direct = rows.is_view(grad, acc)
        view = direct and rows.is_view(logits, acc)
        scratch = None if view else rows.scratch(acc, logits.device)
        for start, end in rows.chunks():
            if view:
                x = rows.read(logits, start, end)
            else:
                x = rows.read_into(logits, start, end, scratch)
            out = rows.read(grad, start, end) if direct else x
            p = _softmax(x, out)
            vp.softmax_minus_onehot_(
                p, local[start:end], scale[start:end], target_weight[start:end]
            )
            if not direct:
                rows.write(grad, start, end, p)
        if unselected is not None:
            rows.zero(grad, unselected)
        return grad, None, None, None, None, None, None, None


def cross_entropy_token_losses(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    *,
    capacity: Capacity = "all",
    num_scored: NumScored | None = None,
    in_place: bool = False,
    chunk_elements: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """``[s, b, v]`` logits, ``[b, s]`` labels and mask -> ``[b, s]`` cross-entropy, 0 unscored.

    Where ``loss_mask`` is non-zero this equals (up to rounding)
    ``F.cross_entropy(logits, labels, reduction="none")`` and so does its gradient; elsewhere
    the loss is 0 and carries no gradient, whatever the label. A ``[b, s]`` output lets any
    weighting or normalization (:mod:`bert_reduce.normalization`) follow, while the caller's
    logits are never copied whole, never modified (unless ``in_place``), and no
    row outside the selection is normalized. ``capacity``: ``docs/fast_path.md``.

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
        num_scored: The data pipeline's count of scored positions
            (:data:`~bert_reduce.num_scored.NumScored`: an ``int``, or e.g. the collator's
            per-sample ``[b]`` counts): computes exactly that many rows, with no host sync when
            it is on the host; overrides ``capacity``. More scored positions than it says make
            the loss NaN (checked on the device).
        in_place: Write the gradient into ``logits`` (see above).
        chunk_elements: About how many logits one chunk reads at a time: trades the extra
            memory (a few fp32 chunks) against per-chunk overhead (kernel launches, thread
            barriers). ``None``: 1/32 of the logits' bytes in fp32, at least 2**20 values.
        tp_group: The group the vocabulary is sharded over (its one all-reduce runs there);
            ``None``: Megatron-Core's tensor-parallel group when its parallel state is
            initialized, else no sharding.

    Returns:
        ``[b, s]`` losses in fp32 (fp64 for fp64 logits): NaN where a scored label is outside
        the vocabulary, and on every scored position when more positions are scored than a
        static ``capacity`` holds (the gradient is then NaN too).

    Raises:
        ValueError: On mismatched shapes, a bad ``capacity`` or ``chunk_elements``, or
            ``in_place`` on a leaf tensor that requires grad.
        TypeError: On a ``num_scored`` that is neither an ``int`` nor an integer tensor.
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
    targets, scored, selection = vp.flat_rows(labels, loss_mask, True, capacity, num_scored)
    rows = _Rows(logits.shape, selection.index, chunk_elements)
    return _CrossEntropyTokenLosses.apply(
        logits, targets, scored != 0, rows, selection.unselected, selection.overflow,
        in_place, tp_group,
    )  # fmt: skip


def cross_entropy_loss_sum(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    normalization: Normalization | str = Normalization.PER_TOKEN,
    *,
    capacity: Capacity = "all",
    num_scored: NumScored | None = None,
    sequence_weight: Tensor | None = None,
    sequence_start: Tensor | None = None,
    constant_per_sequence: int | None = None,
    weight_resolution: int | None = None,
    in_place: bool = False,
    chunk_elements: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """``[s, b, v]`` logits, ``[b, s]`` labels and mask -> ``(loss_sum, denominator)``.

    :func:`cross_entropy_token_losses` followed by
    :func:`bert_reduce.normalization.token_loss_sum`. In the default ``per_token`` mode:
    ``sum(w * F.cross_entropy(logits[mask], labels[mask], reduction="none"))`` (up to
    rounding) with its gradient, for a bool, integer or float (weighting) ``loss_mask``, and
    the mask's :func:`bert_reduce.functional.token_denominator`; the other modes divide by
    what :mod:`bert_reduce.normalization` says.

    Args:
        logits: ``[s, b, v]`` logits, vocab-sharded under tensor parallelism.
        labels: ``[b, s]`` integer token ids.
        loss_mask: ``[b, s]``; non-zero where scored, float entries weight the loss.
        normalization: ``"per_token"`` (default), ``"per_sequence"`` or ``"constant"``.
        capacity: Which rows are computed; see :func:`cross_entropy_token_losses`.
        num_scored: The data pipeline's count of scored positions; see
            :func:`cross_entropy_token_losses`.
        sequence_weight: As in :func:`bert_reduce.normalization.token_loss_sum`.
        sequence_start: As in :func:`bert_reduce.normalization.token_loss_sum`.
        constant_per_sequence: As in :func:`bert_reduce.normalization.token_loss_sum`.
        weight_resolution: As in :func:`bert_reduce.normalization.token_loss_sum`.
        in_place: Write the gradient into ``logits``; see :func:`cross_entropy_token_losses`.
        chunk_elements: About how many logits one chunk reads at a time (``None``: adaptive).
        tp_group: The vocab-sharding group; see :func:`cross_entropy_token_losses`.

    Returns:
        ``(loss_sum, denominator)``: the mode's 0-dim numerator in fp32 (fp64 for fp64
        logits) carrying the gradient, NaN on an out-of-vocabulary scored label or a capacity
        overflow; and its 0-dim denominator (per token: the int64 token count, or the fp64
        sum of float weights).

    Raises:
        ValueError: As :func:`cross_entropy_token_losses` and
            :func:`bert_reduce.normalization.token_loss_sum`.
    """
    losses = cross_entropy_token_losses(
        logits,
        labels,
        loss_mask,
        capacity=capacity,
        num_scored=num_scored,
        in_place=in_place,
        chunk_elements=chunk_elements,
        tp_group=tp_group,
    )
    return token_loss_sum(
        losses,
        loss_mask,
        normalization,
        sequence_weight=sequence_weight,
        sequence_start=sequence_start,
        constant_per_sequence=constant_per_sequence,
        weight_resolution=weight_resolution,
    )


def unreduced_token_loss_fn(
    logits: Tensor, labels: Tensor, cross_entropy_loss_fusion: bool = False
) -> Tensor:
    """``[s, b, v]`` logits and ``[b, s]`` labels -> ``[b, s]`` cross-entropy of every position.

    BioNeMo's name and signature, for code ported from it (``docs/bionemo.md``). With
    Megatron-Core's parallel state initialized this is Megatron's vocab-parallel
    cross-entropy (what ``BERTMLMLossWithReduction(cross_entropy="megatron")`` runs); without
    it, :func:`cross_entropy_token_losses` with every position scored. Unlike BioNeMo's
    function, the caller's ``logits`` are never modified: Megatron-Core's kernels subtract
    the max and exponentiate in place, so they work on a private fp32 copy.

    A label outside ``[0, vocab)`` (``vocab`` being the full, unsharded vocabulary) gives a NaN
    loss at its position: padding labels such as ``-100`` are harmless once a mask drops
    those positions without arithmetic (:func:`bert_reduce.normalization.token_loss_sum`),
    while an invalid label on a masked position makes the loss NaN instead of silently wrong.

    Args:
        logits: ``[s, b, v]`` logits; under tensor parallelism ``v`` is this rank's vocab shard.
            Any float dtype; the maths runs in fp32 (fp64 when ``logits`` are fp64 and no
            Megatron parallel state is initialized).
        labels: ``[b, s]`` integer token ids.
        cross_entropy_loss_fusion: Use Megatron-Core's fused vocab-parallel cross-entropy (one
            all-reduce instead of two for the sums under TP). Its gradient is computed in bf16,
            whatever the logits' dtype. Needs Megatron's parallel state.

    Returns:
        ``[b, s]`` per-token losses in the accumulation dtype (fp32, or fp64).

    Raises:
        ValueError: On mismatched shapes, or when the fused kernel is asked for without an
            initialized Megatron parallel state.
    """
    check_logits_and_labels(logits, labels)
    if not distributed.megatron_is_initialized():
        if cross_entropy_loss_fusion:
            raise ValueError(
                "Megatron-Core's fused cross-entropy (cross_entropy_loss_fusion=True) needs "
                "Megatron-Core's parallel state "
                "(megatron.core.parallel_state.initialize_model_parallel)."
            )
        every_position = torch.ones(labels.shape, dtype=torch.bool, device=labels.device)
        return cross_entropy_token_losses(logits, labels, every_position)

    labels_sb = labels.transpose(0, 1).to(torch.int64)  # gather takes int64 indices
    vocab_size = logits.size(-1) * distributed.tensor_parallel_world_size()
    # Megatron works in fp32 in place, on a [s * b, v] view: hand it a private contiguous copy.
    work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    target = labels_sb.contiguous()
    if cross_entropy_loss_fusion:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        loss_sb = fused_vocab_parallel_cross_entropy(
            work, target, distributed.tensor_parallel_group()
        )
    else:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        loss_sb = vocab_parallel_cross_entropy(work, target)
    in_vocab = (labels_sb >= 0) & (labels_sb < vocab_size)
    loss_sb = torch.where(in_vocab, loss_sb, torch.nan)
    return loss_sb.transpose(0, 1).contiguous()
