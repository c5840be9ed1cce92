"""Cross-entropy on ``[s, b, v]`` logits that computes only what the loss mask needs.

Which rows are read and written, at what price (``capacity``, host syncs):
``docs/fast_path.md``; chunks, memory and the one all-reduce under tensor parallelism:
``docs/performance.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from bert_reduce import _vocab_parallel as vp
from bert_reduce import distributed
from bert_reduce._vocab_parallel import Capacity
from bert_reduce.functional import (
    accumulation_dtype,
    check_same_device,
    check_same_shape,
    check_token_tensor,
)
from bert_reduce.normalization import Normalization, token_loss_sum
from bert_reduce.num_scored import NumScored

__all__ = [
    "Capacity",
    "cross_entropy_loss_sum",
    "cross_entropy_token_losses",
    "unreduced_token_loss_fn",
]

_MIN_CHUNK_ELEMENTS = 1 << 20
_CHUNKS_PER_LOGITS = 32


class _Rows:
    """Reads and writes the ``selection``'s rows ``r = i_s * b + i_b`` of ``[s, b, v]`` tensors.

    Without an ``index`` (every row, in order) chunks are slices, views when the tensor is
    contiguous.
    """

    def __init__(self, shape: torch.Size, selection: vp.RowSelection, chunk_elements: int) -> None:
        self.seq_len, self.batch_size, self.vocab = shape
        self.selection = selection
        self.index = index = selection.index
        self.count = self.seq_len * self.batch_size if index is None else index.numel()
        self.chunk = max(1, chunk_elements // max(1, self.vocab))

    def chunks(self) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk, self.count)) for a in range(0, self.count, self.chunk)]

    def _coordinates(self, start: int, end: int, device: torch.device) -> tuple[Tensor, Tensor]:
        index = self.index
        rows = torch.arange(start, end, device=device) if index is None else index[start:end]
        return rows.div(self.batch_size, rounding_mode="floor"), rows.remainder(self.batch_size)

    def read(self, tensor: Tensor, start: int, end: int, scratch: Tensor | None = None) -> Tensor:
        """Rows ``[start, end)``: in ``scratch`` (its dtype) if given, else a view if possible."""
        out = None if scratch is None else scratch[: end - start]
        if not tensor.is_contiguous():
            rows = tensor[self._coordinates(start, end, tensor.device)]
        elif self.index is None:
            rows = tensor.view(-1, self.vocab)[start:end]
        elif out is not None and tensor.dtype == out.dtype:
            # Gathered straight into the buffer: one copy, not a gather and then a copy.
            flat = tensor.view(-1, self.vocab)
            return torch.index_select(flat, 0, self.index[start:end], out=out)
        else:
            rows = tensor.view(-1, self.vocab).index_select(0, self.index[start:end])
        return rows if out is None else out.copy_(rows)

    def scratch(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A ``[chunk, v]`` buffer allocated once per call, not once per chunk."""
        return torch.empty(min(self.chunk, self.count), self.vocab, dtype=dtype, device=device)

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


class _CrossEntropyTokenLosses(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        scored: Tensor,
        rows: _Rows,
        in_place: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        """:func:`cross_entropy_token_losses` on ``rows``, with their ``[rows]`` targets, scored."""
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
                x = rows.read(logits, start, end, None if view else scratch)
                log_probs = torch.log_softmax(x, -1, out=scratch[: end - start])
                loss[start:end] = log_probs.gather(1, sharded.local[start:end]).squeeze(1).neg_()
            loss = torch.where(sharded.in_vocab, loss, torch.nan)
        else:
            stats = torch.zeros(tp_size, 2, rows.count, dtype=acc, device=logits.device)
            for start, end in rows.chunks():
                x = rows.read(logits, start, end, scratch)
                stats[tp_rank, 1, start:end] = x.gather(1, sharded.local[start:end]).squeeze(1)
                stats[tp_rank, 0, start:end] = vp.logsumexp_(x)
            shard_lse = stats[tp_rank, 0].clone()
            lse, target_logit = vp.combine_shard_stats(stats, sharded, tp_group)
            loss = vp.row_losses(lse, target_logit, sharded.in_vocab)
            # softmax over the vocabulary = this shard's softmax * exp(lse_shard - lse).
            shard_share = torch.exp(shard_lse - lse)
        losses, scored = vp.scatter_losses(loss, scored, rows.selection, seq_len * batch_size)
        ctx.rows, ctx.in_place = rows, in_place
        ctx.save_for_backward(logits, sharded.local, sharded.in_shard, scored, shard_share)
        return losses.view(seq_len, batch_size).t().contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor | None, ...]:
        logits, local, in_shard, scored, shard_share = ctx.saved_tensors
        rows: _Rows = ctx.rows
        _, unselected, overflow = rows.selection
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
            x = rows.read(logits, start, end, scratch)
            out = rows.read(grad, start, end) if direct else x
            # dL/dx = coef * (softmax - onehot), in place; `scale` carries the shard's share.
            p = torch.softmax(x, -1, out=out).mul_(scale[start:end, None])
            p.scatter_add_(1, local[start:end], -target_weight[start:end, None])
            if not direct:
                rows.write(grad, start, end, p)
        if unselected is not None:
            rows.zero(grad, unselected)
        return grad, None, None, None, None, None


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

    Where ``loss_mask`` is non-zero this equals ``F.cross_entropy(logits, labels,
    reduction="none")`` (up to rounding), and so does its gradient; elsewhere the loss is 0
    with no gradient, whatever the label. The logits are never copied whole nor modified
    (unless ``in_place``). ``capacity`` and ``num_scored``: ``docs/fast_path.md``.

    Args:
        logits: ``[s, b, v]`` logits, any float dtype; under tensor parallelism ``v`` is this
            rank's contiguous vocab shard (rank ``r`` holds ids ``[r * v, (r + 1) * v)``,
            Megatron-Core's ``VocabUtility`` layout).
        labels: ``[b, s]`` integer token ids; unscored positions may hold anything (``-100``).
        loss_mask: ``[b, s]`` bool, integer or float; non-zero entries are scored.
        capacity: ``"all"`` (default), ``"nonzero"``, a row count or a fraction of ``b * s``.
        num_scored: As in :func:`bert_reduce.linear_cross_entropy_token_losses`.
        in_place: Write the gradient into the logits' own storage: only safe for non-leaf
            logits that nothing reads after this loss (``docs/performance.md``).
        chunk_elements: About how many logits one chunk reads (``None``: 1/32 of the logits'
            bytes in fp32, at least 2**20 values).
        tp_group: As in :func:`bert_reduce.linear_cross_entropy_token_losses`.

    Returns:
        ``[b, s]`` losses in fp32 (fp64 for fp64 logits), NaN as in
        :func:`bert_reduce.linear_cross_entropy_token_losses`.

    Raises:
        ValueError: On mismatched shapes, a bad ``capacity`` or ``chunk_elements``, or
            ``in_place`` on a leaf tensor that requires grad.
        TypeError: On a ``num_scored`` that is neither an ``int`` nor an integer tensor.

    Example:
        >>> logits = torch.zeros(3, 1, 4)  # [s, b, v]: uniform over 4 tokens
        >>> losses = cross_entropy_token_losses(
        ...     logits, torch.tensor([[1, -100, 2]]), torch.tensor([[True, False, True]])
        ... )
        >>> losses
        tensor([[1.3863, 0.0000, 1.3863]])
    """
    check_token_tensor(logits, labels, "token_logits", "sbv")
    check_same_shape(loss_mask, labels, ("loss_mask", "labels"), "[b, s]")
    check_same_device(loss_mask, labels, ("loss_mask", "labels"))
    if chunk_elements is None:  # chunks whose fp32 copy is 1/32 of the logits' bytes, not tiny
        acc_size = accumulation_dtype(logits.dtype).itemsize
        per_chunk = logits.numel() * logits.element_size() // (_CHUNKS_PER_LOGITS * acc_size)
        chunk_elements = max(_MIN_CHUNK_ELEMENTS, per_chunk)
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}.")
    if in_place and logits.requires_grad and logits.is_leaf:
        raise ValueError(
            "in_place=True would write the gradient into a leaf tensor's data; pass the "
            "non-leaf logits of the model instead."
        )
    targets, scored, selection = vp.flat_rows(labels, loss_mask, True, capacity, num_scored)
    rows = _Rows(logits.shape, selection, chunk_elements)
    return _CrossEntropyTokenLosses.apply(logits, targets, scored != 0, rows, in_place, tp_group)


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
    :func:`bert_reduce.normalization.token_loss_sum`; the arguments are theirs.

    Returns:
        ``(loss_sum, denominator)`` as :func:`bert_reduce.normalization.token_loss_sum` returns
        them, the numerator carrying the gradient (NaN as the token losses are).

    Raises:
        ValueError, TypeError: As :func:`cross_entropy_token_losses` and
            :func:`bert_reduce.normalization.token_loss_sum`.

    Example:
        >>> logits = torch.zeros(3, 1, 4)  # [s, b, v]: uniform over 4 tokens
        >>> labels, mask = torch.tensor([[1, -100, 2]]), torch.tensor([[True, False, True]])
        >>> loss_sum, denominator = cross_entropy_loss_sum(logits, labels, mask)
        >>> loss_sum / denominator  # log(4)
        tensor(1.3863)
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

    BioNeMo's name and signature, for code ported from it; what it runs with and without
    Megatron-Core's parallel state: ``docs/bionemo.md``.

    Args:
        logits: ``[s, b, v]`` logits (this rank's vocab shard under tensor parallelism).
        labels: ``[b, s]`` integer token ids.
        cross_entropy_loss_fusion: Use Megatron-Core's fused vocab-parallel cross-entropy
            (its gradient is computed in bf16). Needs Megatron's parallel state.

    Returns:
        ``[b, s]`` per-token losses in fp32 (fp64 for fp64 logits without Megatron), NaN where
        a label is outside the full vocabulary (``-100``).

    Raises:
        ValueError: On mismatched shapes, or the fused kernel without Megatron's parallel
            state.

    Example:
        >>> unreduced_token_loss_fn(torch.zeros(2, 1, 4), torch.tensor([[0, -100]]))
        tensor([[1.3863,    nan]])
    """
    check_token_tensor(logits, labels, "token_logits", "sbv")
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
