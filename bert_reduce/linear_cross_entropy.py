"""Masked-only language-model head: the output projection and the cross-entropy, fused.

An MLM loss scores ~15% of the positions, yet ``F.linear(hidden, weight)`` followed by any
cross-entropy computes, stores and back-propagates ``[s, b, v]`` logits for all of them.
:func:`linear_masked_token_losses` computes the logits of the *selected* rows only, a chunk
of ``[rows, vocab]`` at a time, and never holds more than a few chunks:

* forward: for each chunk of rows and of the vocabulary, ``x = h_rows @ w_chunk^T + b``;
  an online log-sum-exp over the vocabulary chunks and the target logit are kept per row
  (``[rows]`` each), the chunk is dropped;
* backward: the chunk is recomputed and turned into ``dL/dx = coef * (softmax - onehot)``,
  which is immediately multiplied into ``dL/dh_rows += dx @ w_chunk`` and
  ``dL/dw_chunk += dx^T @ h_rows`` (and ``dL/db_chunk += sum(dx)``).

Work is ``8 * rows * v * h`` multiply-adds against ``6 * b * s * v * h`` for the dense head
(its forward and two backward products), so at 15% masked with the rows counted by the data
pipeline it is ~0.2x of the dense arithmetic, and the extra memory is a few chunks.

Accumulation is in fp32 for bf16/fp16 inputs (fp64 for fp64): each chunk's logits are
computed in the input dtype, as ``F.linear`` would, then read in the accumulation dtype; the
gradients are summed over chunks in it and cast once.

Which rows are computed is :mod:`bert_reduce.cross_entropy`'s choice (``capacity``, or
``num_scored`` from the data pipeline), with the same guarantees: exact, no host sync, NaN on
an overflowing static capacity. Under tensor parallelism ``weight`` (and ``bias``) are this
rank's vocab shard and the per-row (log-sum-exp, target logit) of every shard are combined in
ONE all-reduce, as in :func:`bert_reduce.masked_token_losses`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from bert_reduce.cross_entropy import (
    Capacity,
    NumScored,
    RowSelection,
    combine_shard_stats,
    logsumexp_,
    scatter_row_losses,
    select_rows,
    shard_stats,
    shard_targets,
    tensor_parallel_placement,
)
from bert_reduce.functional import accumulation_dtype, check_same_device

__all__ = [
    "HIDDEN_LAYOUT_KEY",
    "HIDDEN_STATES_KEY",
    "OUTPUT_BIAS_KEY",
    "OUTPUT_WEIGHT_KEY",
    "HiddenLayout",
    "head_logits",
    "linear_masked_token_losses",
]

HIDDEN_STATES_KEY = "hidden_states"
"""``forward_out`` key of the hidden states that enter the output layer."""
OUTPUT_WEIGHT_KEY = "output_weight"
"""``forward_out`` key of the output layer's ``[v, h]`` weight."""
OUTPUT_BIAS_KEY = "output_bias"
"""``forward_out`` key of the output layer's ``[v]`` bias (optional)."""
HIDDEN_LAYOUT_KEY = "hidden_layout"
"""``forward_out`` key of the hidden states' :data:`HiddenLayout` (optional, ``"sbh"``)."""

HiddenLayout = Literal["sbh", "bsh"]
"""``"sbh"``: ``[s, b, h]`` hidden states (Megatron); ``"bsh"``: ``[b, s, h]`` (Hugging Face)."""

_CHUNK_ELEMENTS = 1 << 21
_CHUNK_VOCAB = 4096


class _Chunks:
    """Row and vocabulary chunk boundaries of one call."""

    def __init__(self, rows: int, vocab: int, chunk_rows: int, chunk_vocab: int) -> None:
        self.rows = [(a, min(a + chunk_rows, rows)) for a in range(0, rows, chunk_rows)]
        self.vocab = [(a, min(a + chunk_vocab, vocab)) for a in range(0, vocab, chunk_vocab)]


def _chunk_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, vocab: tuple[int, int], acc: torch.dtype
) -> Tensor:
    """``[c, v_chunk]`` logits of a row chunk, in ``acc``, in a buffer the caller may overwrite."""
    start, end = vocab
    x = F.linear(hidden, weight[start:end], None if bias is None else bias[start:end])
    # F.linear's output is fresh: converting it makes a fresh buffer too.
    return x.to(acc)


def _hit_in_chunk(
    local: Tensor, in_shard: Tensor, rows: tuple[int, int], vocab: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Each row's target column in a vocab chunk (0 if elsewhere), and whether it is there.

    Args:
        local: ``[rows, 1]`` target ids within this rank's shard.
        in_shard: ``[rows]`` whether the target lies in the shard.
        rows: The row chunk ``[start, end)``.
        vocab: The vocab chunk ``[start, end)`` within the shard.

    Returns:
        ``(column, inside)``, both ``[c, 1]``.
    """
    column = local[rows[0] : rows[1]] - vocab[0]
    inside = (column >= 0) & (column < vocab[1] - vocab[0])
    inside &= in_shard[rows[0] : rows[1]].unsqueeze(1)
    return torch.where(inside, column, 0), inside


class _LinearMaskedTokenLosses(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        scored: Tensor,
        selection: RowSelection,
        chunks: tuple[int, int],
        tp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        """``[positions]`` losses of the flat ``[positions, h]`` ``hidden``'s selected rows.

        ``targets`` and ``scored`` are ``[rows]``, aligned with ``selection.index``.
        """
        _, _, tp_rank = tensor_parallel_placement(tp_group)
        acc = accumulation_dtype(hidden.dtype)
        index = selection.index
        rows_hidden = hidden if index is None else hidden.index_select(0, index)
        num_rows, shard = rows_hidden.size(0), weight.size(0)
        sharded = shard_targets(targets, shard, tp_group)
        plan = _Chunks(num_rows, shard, *chunks)
        stats = shard_stats(num_rows, acc, hidden.device, tp_group)
        lse, target_logit = stats[tp_rank, 0], stats[tp_rank, 1]
        lse.fill_(-torch.inf)
        for rows in plan.rows:
            part = rows_hidden[rows[0] : rows[1]]
            for vocab in plan.vocab:
                x = _chunk_logits(part, weight, bias, vocab, acc)
                column, inside = _hit_in_chunk(sharded.local, sharded.in_shard, rows, vocab)
                target_logit[rows[0] : rows[1]] += torch.where(
                    inside, x.gather(1, column), 0
                ).squeeze(1)
                # Online log-sum-exp over vocabulary chunks: lse = log(exp(lse) + sum(exp(x))).
                running = lse[rows[0] : rows[1]]
                torch.logaddexp(running, logsumexp_(x), out=running)
        global_lse, global_target = combine_shard_stats(stats, sharded, tp_group)
        losses, scored = scatter_row_losses(
            global_lse, global_target, sharded, scored, selection, hidden.size(0)
        )
        ctx.chunks, ctx.positions, ctx.has_bias = chunks, hidden.size(0), bias is not None
        ctx.save_for_backward(
            rows_hidden,
            weight,
            bias,
            global_lse,
            sharded.local,
            sharded.in_shard,
            scored,
            index,
            selection.overflow,
        )
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor | None, ...]:
        rows_hidden, weight, bias, lse, local, in_shard, scored, index, overflow = ctx.saved_tensors
        acc = lse.dtype
        dtype = rows_hidden.dtype
        coef = grad_losses.to(acc)
        if index is not None:
            coef = coef[index]
        # dL/dx_r = coef_r * (softmax(x_r) - onehot(target_r)), on scored rows only.
        coef = torch.where(scored, coef, 0)
        if overflow is not None:
            coef = torch.where(overflow.any(), torch.nan, coef)
        coef = coef.unsqueeze(1)
        num_rows, shard = rows_hidden.size(0), weight.size(0)
        plan = _Chunks(num_rows, shard, *ctx.chunks)
        grad_rows = torch.zeros(num_rows, rows_hidden.size(1), dtype=acc, device=lse.device)
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format)
        grad_bias = torch.empty_like(bias) if ctx.has_bias else None
        for vocab in plan.vocab:
            w = weight[vocab[0] : vocab[1]]
            # The weight chunk's gradient sums over every row chunk, in `acc`.
            grad_w = grad_weight[vocab[0] : vocab[1]]
            grad_w_acc = grad_w.zero_() if dtype == acc else torch.zeros_like(w, dtype=acc)
            grad_b_acc = torch.zeros(vocab[1] - vocab[0], dtype=acc, device=lse.device)
            for rows in plan.rows:
                part = rows_hidden[rows[0] : rows[1]]
                x = _chunk_logits(part, weight, bias, vocab, acc)
                x.sub_(lse[rows[0] : rows[1]].unsqueeze(1)).exp_()
                column, inside = _hit_in_chunk(local, in_shard, rows, vocab)
                x.scatter_add_(1, column, -inside.to(acc))
                x.mul_(coef[rows[0] : rows[1]])
                grad_b_acc += x.sum(dim=0)
                dx = x.to(dtype)
                if dtype == acc:
                    grad_rows[rows[0] : rows[1]].addmm_(dx, w)
                    grad_w_acc.addmm_(dx.t(), part)
                else:
                    grad_rows[rows[0] : rows[1]] += dx @ w
                    grad_w_acc += dx.t() @ part
            if grad_w_acc is not grad_w:
                grad_w.copy_(grad_w_acc)
            if grad_bias is not None:
                grad_bias[vocab[0] : vocab[1]] = grad_b_acc
        if index is None:
            grad_hidden = grad_rows.to(dtype)
        else:
            grad_hidden = rows_hidden.new_zeros(ctx.positions, rows_hidden.size(1))
            grad_hidden.index_copy_(0, index, grad_rows.to(dtype))
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _check_shapes(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    bias: Tensor | None,
    layout: HiddenLayout,
    sequence_parallel: bool,
    tp_size: int,
) -> None:
    if layout not in ("sbh", "bsh"):
        raise ValueError(f"layout must be 'sbh' ([s, b, h]) or 'bsh' ([b, s, h]), got {layout!r}.")
    if labels.dim() != 2 or loss_mask.shape != labels.shape:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} and loss_mask of shape "
            f"{tuple(loss_mask.shape)} must both be [b, s]."
        )
    batch_size, seq_len = labels.shape
    if sequence_parallel:
        seq_len //= tp_size
    expected = (seq_len, batch_size) if layout == "sbh" else (batch_size, seq_len)
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != expected:
        shard = " (this rank's sequence shard)" if sequence_parallel else ""
        raise ValueError(
            f"hidden of shape {tuple(hidden.shape)} must be [{layout[0]}, {layout[1]}, h] = "
            f"[{expected[0]}, {expected[1]}, h]{shard} for labels of shape "
            f"{tuple(labels.shape)} ([b, s]) and layout={layout!r}."
        )
    if weight.dim() != 2 or weight.size(1) != hidden.size(2):
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} must be [v, h] with h = {hidden.size(2)} "
            f"(hidden's last dim)."
        )
    if bias is not None and tuple(bias.shape) != (weight.size(0),):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} must be [v] = [{weight.size(0)}] like weight's "
            "first dim."
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}.")
    check_same_device(hidden, weight, ("hidden", "weight"))
    check_same_device(hidden, labels, ("hidden", "labels"))
    check_same_device(loss_mask, labels, ("loss_mask", "labels"))
    if bias is not None:
        check_same_device(weight, bias, ("weight", "bias"))
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias "
            f"({None if bias is None else bias.dtype}) must share one dtype, as F.linear needs."
        )


def _gather_sequence_parallel(hidden: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    """The whole ``[s, b, h]`` from this rank's ``[s / tp, b, h]``, as Megatron's linear does.

    Megatron-Core's own mapping: all-gather along ``s`` in forward, reduce-scatter of the
    (vocab-shard partial) gradient in backward, so the gradient of the local shard is whole.
    """
    group, tp_size, _ = tensor_parallel_placement(tp_group)
    if tp_size == 1:
        return hidden
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(
        hidden, tensor_parallel_output_grad=True, group=group
    )


def linear_masked_token_losses(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    *,
    bias: Tensor | None = None,
    capacity: Capacity = "all",
    num_scored: NumScored | None = None,
    layout: HiddenLayout = "sbh",
    sequence_parallel: bool = False,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Per-token cross-entropy of ``F.linear(hidden, weight, bias)``, on the scored rows only.

    Equal (up to rounding) to ``masked_token_losses(F.linear(hidden, weight, bias), labels,
    loss_mask)`` with the same gradients w.r.t. ``hidden``, ``weight`` and ``bias``, while
    computing only the selected rows' logits, a chunk at a time: the ``[s, b, v]`` logits and
    their gradient never exist. Unscored positions get loss 0 and no gradient.

    Under tensor parallelism ``weight`` and ``bias`` are this rank's contiguous vocab shard
    (rank ``r`` holds ids ``[r * v, (r + 1) * v)``), the forward runs ONE all-reduce, and, as
    with ``F.linear`` on the shard, the gradient w.r.t. a replicated ``hidden`` is this
    shard's part: sum it over the TP group as Megatron's ``ColumnParallelLinear`` does (pass
    ``hidden`` through ``copy_to_tensor_model_parallel_region``). With
    ``sequence_parallel=True``, ``hidden`` is this rank's ``[s / tp, b, h]`` sequence shard:
    it is all-gathered, and its gradient reduce-scattered, by Megatron-Core's own mapping
    (the gradient is then whole).

    Args:
        hidden: ``[s, b, h]`` hidden states (``layout="sbh"``, Megatron) or ``[b, s, h]``
            (``layout="bsh"``, Hugging Face), any float dtype.
        weight: ``[v, h]`` output-layer weight (this rank's vocab shard under TP).
        labels: ``[b, s]`` integer token ids; unscored positions may hold anything.
        loss_mask: ``[b, s]`` bool, integer or float; non-zero entries are scored.
        bias: ``[v]`` output-layer bias, or ``None``.
        capacity: Which rows are computed: ``"all"``, ``"nonzero"``, a row count or a fraction
            of ``b * s``; see :mod:`bert_reduce.cross_entropy`. ``"all"`` does MORE work than
            the dense head (every row's logits twice); use a count.
        num_scored: The data pipeline's count of scored positions: an ``int`` (the
            micro-batch's total, which no device transfer touches) or an integer tensor of
            counts (e.g. the collator's ``[b]`` per-sample counts). Exactly that many rows are
            computed, with no host sync when it is on the host (a tensor on the accelerator is
            read once). Overrides ``capacity``; see :func:`bert_reduce.cross_entropy.select_rows`.
        layout: ``"sbh"`` or ``"bsh"``, the layout of ``hidden``.
        sequence_parallel: ``hidden`` is Megatron's sequence-parallel shard (``"sbh"`` only).
        chunk_rows: Rows per chunk (``None``: about 2**21 logits per chunk).
        chunk_vocab: Vocabulary entries per chunk (``None``: ``min(v, 4096)``).
        tp_group: The group the vocabulary is sharded over; ``None``: Megatron-Core's
            tensor-parallel group when its parallel state is initialized, else no sharding.

    Returns:
        ``[b, s]`` losses in fp32 (fp64 for fp64 inputs): NaN where a scored label is outside
        the vocabulary, and on every scored position when more positions are scored than the
        capacity (or ``num_scored``) allows (the gradients are then NaN too).

    Raises:
        ValueError: On mismatched shapes, dtypes or devices (the message names them),
            non-integer labels, a bad ``layout``, ``capacity``, chunk size, or
            ``sequence_parallel`` with ``"bsh"``.
    """
    if sequence_parallel and layout != "sbh":
        raise ValueError("sequence_parallel=True needs layout='sbh' (Megatron's [s/tp, b, h]).")
    _, tp_size, _ = tensor_parallel_placement(tp_group)
    _check_shapes(hidden, weight, labels, loss_mask, bias, layout, sequence_parallel, tp_size)
    if sequence_parallel:
        hidden = _gather_sequence_parallel(hidden, tp_group)
    vocab = weight.size(0)
    chunk_vocab = min(vocab, _CHUNK_VOCAB) if chunk_vocab is None else chunk_vocab
    chunk_rows = max(1, _CHUNK_ELEMENTS // chunk_vocab) if chunk_rows is None else chunk_rows
    if chunk_rows < 1 or chunk_vocab < 1:
        raise ValueError(
            f"chunk_rows and chunk_vocab must be positive, got {chunk_rows} and {chunk_vocab}."
        )
    # Flat row r follows hidden's memory order: r = i_s * b + i_b ("sbh"), i_b * s + i_s ("bsh").
    scored, targets = (loss_mask != 0), labels
    if layout == "sbh":
        scored, targets = scored.transpose(0, 1), targets.transpose(0, 1)
    # Any integer label dtype; gather takes int64.
    scored, targets = scored.reshape(-1), targets.reshape(-1).to(torch.int64)
    selection = select_rows(scored, capacity, num_scored)
    if selection.index is not None:
        targets, scored = targets[selection.index], scored[selection.index]
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    losses = _LinearMaskedTokenLosses.apply(
        flat_hidden, weight, bias, targets, scored, selection, (chunk_rows, chunk_vocab), tp_group
    )
    batch_size, seq_len = labels.shape
    if layout == "sbh":
        return losses.view(seq_len, batch_size).t().contiguous()
    return losses.view(batch_size, seq_len)


def head_logits(forward_out: Mapping[str, Any]) -> Tensor:
    """The ``[s, b, v]`` logits of a ``forward_out`` that carries the output layer's inputs.

    For the losses that need every logit (Megatron-Core's cross-entropy).

    Args:
        forward_out: :data:`HIDDEN_STATES_KEY`, :data:`OUTPUT_WEIGHT_KEY`, optionally
            :data:`OUTPUT_BIAS_KEY` and :data:`HIDDEN_LAYOUT_KEY`.

    Returns:
        ``F.linear(hidden, weight, bias)``, sequence first.
    """
    hidden = forward_out[HIDDEN_STATES_KEY]
    logits = F.linear(hidden, forward_out[OUTPUT_WEIGHT_KEY], forward_out.get(OUTPUT_BIAS_KEY))
    return logits.transpose(0, 1) if forward_out.get(HIDDEN_LAYOUT_KEY) == "bsh" else logits
