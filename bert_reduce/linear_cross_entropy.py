"""Masked-only language-model head: the output projection and the cross-entropy, fused.

An MLM loss scores ~15% of the positions, yet ``F.linear(hidden, weight)`` followed by any
cross-entropy computes, stores and back-propagates ``[s, b, v]`` logits for all of them.
This module computes the logits of the *selected* rows only, a chunk at a time, and never
holds more than a few chunks. The entry points, named like :mod:`bert_reduce.cross_entropy`'s
(``linear_cross_entropy_`` + what they return):

* :func:`linear_cross_entropy_loss_sum`: ``(loss_sum, denominator)`` in a normalization mode
  (per token by default), what every integration of the library calls: the mode's weights
  (:func:`bert_reduce.normalization.normalization_weights`) are known in the forward, so it
  runs :func:`linear_cross_entropy_weighted_sum`.
* :func:`linear_cross_entropy_weighted_sum`: ``sum(w * loss)`` with per-token weights known in
  the forward. For each chunk of rows the logits over the whole vocabulary
  ``x = h_rows @ w^T + b`` give the losses and at once
  ``dL/dx = w * (softmax - onehot)``, multiplied into ``dL/dh_rows = dx @ w``,
  ``dL/dw += dx^T @ h_rows`` and ``dL/db += sum(dx)``; the backward only scales these by
  the upstream gradient. Three products: ``6 * rows * v * h`` multiply-adds against
  ``6 * b * s * v * h`` for the dense head, so ~0.15x of its arithmetic at 15% masked.
* :func:`linear_cross_entropy_token_losses`: the ``[b, s]`` per-token losses, for a caller
  that weights them later (or needs each token's loss, as per-sample evaluation does). The
  forward keeps an online log-sum-exp and the target logit per row over ``[rows, vocab]``
  chunks; the backward recomputes each chunk into
  ``dL/dx = coef * (softmax - onehot)``. Four products (``8 * rows * v * h``).

**Which rows, and when it syncs**: by default the scored rows, counted on the device (one
host sync per call on an accelerator); ``num_scored`` or a static ``capacity`` avoid it, and
``torch.compile`` buckets the count (:func:`compile_bucket`): see ``docs/fast_path.md``. The
row selection, the shard statistics and the
softmax-minus-one-hot gradient are shared with :mod:`bert_reduce.cross_entropy`
(:mod:`bert_reduce._vocab_parallel`).

Accumulation is in fp32 for bf16/fp16 inputs (fp64 for fp64): each chunk's logits are
computed in the input dtype, as ``F.linear`` would, then read in the accumulation dtype; the
gradients are summed over chunks in it and cast once. Under tensor parallelism ``weight``
(and ``bias``) are this rank's vocab shard and the per-row (log-sum-exp, target logit) of
every shard are combined in ONE all-reduce, as in
:func:`bert_reduce.cross_entropy_token_losses`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from bert_reduce._vocab_parallel import (
    Capacity,
    RowSelection,
    ShardedTargets,
    combine_shard_stats,
    flat_rows,
    logsumexp_,
    row_coefficients,
    row_losses,
    scatter_row_losses,
    shard_stats,
    shard_targets,
    softmax_minus_onehot_,
    tensor_parallel_placement,
)
from bert_reduce.forward_output import Layout, check_layout
from bert_reduce.functional import accumulation_dtype, check_same_device
from bert_reduce.normalization import Normalization, normalization_weights
from bert_reduce.num_scored import NumScored

__all__ = [
    "compile_bucket",
    "linear_cross_entropy_loss_sum",
    "linear_cross_entropy_token_losses",
    "linear_cross_entropy_weighted_sum",
    "row_chunks",
]

_CHUNK_ELEMENTS = 1 << 21
_CHUNK_VOCAB = 4096
# One pass holds a row chunk's logits over the whole vocabulary: larger chunks keep the
# products efficient (on one CPU thread, a 512-wide head's products ran up to 1.6x faster per
# row in chunks of 160 rows than of 80), at 16 MiB of fp32.
_SINGLE_PASS_ELEMENTS = 1 << 22


COMPILE_BUCKETS = 16
"""Under ``torch.compile``, row counts share a graph per 1/16 of the positions."""


def compile_bucket(count: int, positions: int) -> int:
    """``count`` rounded up to a multiple of ``ceil(positions / 16)``, at most ``positions``.

    Under ``torch.compile`` the number of row chunks follows this bucket rather than the
    count itself (:func:`row_chunks`), so that one graph serves every count of a bucket:
    dynamo compiles the first count as a constant, then makes it a dynamic integer whose
    guards only compare it with the bucket's bounds. Micro-batches masked at 9% to 21% of
    the positions then run in at most 3 graphs after the first.
    """
    granule = -(-positions // COMPILE_BUCKETS)
    # Floor divisions and min only: on a symbolic count (dynamo's dynamic ints) the bucket
    # stays an expression that dynamo can guard on.
    return min(positions, -(-count // granule) * granule) if granule else count


def row_chunks(rows: int, chunk_rows: int, positions: int) -> list[tuple[int, int]]:
    """``[start, end)`` of balanced chunks of at most ``chunk_rows`` of ``rows`` rows.

    Chunk ``i`` of ``k`` is ``[i * rows // k, (i + 1) * rows // k)``. Eager mode takes
    ``k = ceil(rows / chunk_rows)``; under ``torch.compile`` ``k`` comes from the
    :func:`compile_bucket` of ``rows`` among ``positions``, so that a symbolic row count only
    decides the chunks' sizes, never their number (chunks may then be empty). Either way
    exactly ``rows`` rows are computed.
    """
    bound = compile_bucket(rows, positions) if torch.compiler.is_compiling() else rows
    count = -(-bound // chunk_rows)
    return [(i * rows // count, (i + 1) * rows // count) for i in range(count)]


class _Chunks:
    """Row and vocabulary chunk boundaries of one call (see :func:`row_chunks`)."""

    def __init__(
        self, rows: int, vocab: int, chunk_rows: int, chunk_vocab: int, positions: int
    ) -> None:
        self.rows = row_chunks(rows, chunk_rows, positions)
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


def _shard_logsumexp(
    rows_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    sharded: ShardedTargets,
    plan: _Chunks,
    acc: torch.dtype,
    tp_group: dist.ProcessGroup | None,
) -> tuple[Tensor, Tensor]:
    """Every row's global ``(log-sum-exp, target logit)``, ``[rows]`` each: ONE all-reduce.

    One pass over the ``[rows, vocab]`` chunks of this rank's shard keeps an online
    log-sum-exp and the target logit per row; :func:`combine_shard_stats` combines the
    shards'.
    """
    _, _, tp_rank = tensor_parallel_placement(tp_group)
    stats = shard_stats(rows_hidden.size(0), acc, rows_hidden.device, tp_group)
    lse, target_logit = stats[tp_rank, 0], stats[tp_rank, 1]
    lse.fill_(-torch.inf)
    for rows in plan.rows:
        part = rows_hidden[rows[0] : rows[1]]
        for vocab in plan.vocab:
            x = _chunk_logits(part, weight, bias, vocab, acc)
            column, inside = _hit_in_chunk(sharded.local, sharded.in_shard, rows, vocab)
            target = torch.where(inside, x.gather(1, column), 0).squeeze(1)
            target_logit[rows[0] : rows[1]] += target
            # Online log-sum-exp over vocabulary chunks: lse = log(exp(lse) + sum(exp(x))).
            running = lse[rows[0] : rows[1]]
            torch.logaddexp(running, logsumexp_(x), out=running)
    return combine_shard_stats(stats, sharded, tp_group)


class _Gradients(NamedTuple):
    """Gradients of the selected rows (``None`` where not needed).

    Attributes:
        rows: ``[rows, h]``, w.r.t. the selected rows of the hidden states.
        weight: ``[v, h]``, w.r.t. the weight (this rank's shard).
        bias: ``[v]``, w.r.t. the bias.
    """

    rows: Tensor | None
    weight: Tensor | None
    bias: Tensor | None


def _add_chunk_gradients(
    dx: Tensor,
    part: Tensor,
    w: Tensor,
    grad_rows: Tensor | None,
    grad_w: Tensor | None,
    grad_b: Tensor | None,
) -> None:
    """``grad_rows += dx @ w``, ``grad_w += dx^T @ part`` and ``grad_b += sum(dx)``.

    ``dx`` is the ``[c, v_chunk]`` logits gradient in the accumulation dtype, ``part`` the
    chunk's ``[c, h]`` hidden rows and ``w`` its ``[v_chunk, h]`` weight rows; the products
    run in the inputs' dtype, as ``F.linear``'s backward would, and add into the
    accumulators (``None``: not needed).
    """
    if grad_b is not None:
        grad_b += dx.sum(dim=0)
    dx = dx.to(part.dtype)
    for out, a, b in ((grad_rows, dx, w), (grad_w, dx.t(), part)):
        if out is None:
            continue
        if out.dtype == dx.dtype:
            out.addmm_(a, b)
        else:
            out += a @ b


def _softmax_gradients(
    rows_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    local: Tensor,
    in_shard: Tensor,
    coef: Tensor,
    plan: _Chunks,
    needs: tuple[bool, ...],
) -> _Gradients:
    """Gradients of ``sum(coef * loss)`` once the global log-sum-exp is known.

    Each ``[rows, vocab]`` chunk's logits are computed (again) and turned into
    ``dL/dx = coef * (softmax - onehot)``, multiplied straight into the gradients. Vocabulary
    chunks are the outer loop, so that the weight's gradient is accumulated one vocabulary
    chunk at a time (in the accumulation dtype) and cast once into its ``[v, h]`` result.
    """
    acc, dtype = lse.dtype, rows_hidden.dtype
    grad_rows = torch.zeros(rows_hidden.shape, dtype=acc, device=lse.device) if needs[0] else None
    grad_weight = (
        torch.empty_like(weight, memory_format=torch.contiguous_format) if needs[1] else None
    )
    grad_bias = torch.empty_like(bias) if needs[2] and bias is not None else None
    for vocab in plan.vocab:
        w = weight[vocab[0] : vocab[1]]
        grad_w = None
        if grad_weight is not None:
            grad_w = grad_weight[vocab[0] : vocab[1]]
            grad_w = grad_w.zero_() if dtype == acc else torch.zeros_like(w, dtype=acc)
        grad_b = None if grad_bias is None else w.new_zeros(w.size(0), dtype=acc)
        for rows in plan.rows:
            part = rows_hidden[rows[0] : rows[1]]
            x = _chunk_logits(part, weight, bias, vocab, acc)
            # exp(x - lse), lse the global log-sum-exp: the softmax over the whole vocabulary.
            x.sub_(lse[rows[0] : rows[1]].unsqueeze(1)).exp_()
            column, inside = _hit_in_chunk(local, in_shard, rows, vocab)
            c = coef[rows[0] : rows[1]]
            softmax_minus_onehot_(x, column, c, torch.where(inside.squeeze(1), c, 0))
            grad_part = None if grad_rows is None else grad_rows[rows[0] : rows[1]]
            _add_chunk_gradients(x, part, w, grad_part, grad_w, grad_b)
        if grad_weight is not None and dtype != acc:
            grad_weight[vocab[0] : vocab[1]] = grad_w
        if grad_bias is not None:
            grad_bias[vocab[0] : vocab[1]] = grad_b
    return _Gradients(grad_rows, grad_weight, grad_bias)


def _single_pass(
    hidden: Tensor,
    index: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    sharded: ShardedTargets,
    coef: Tensor,
    chunk_rows: int,
    acc: torch.dtype,
    needs: tuple[bool, ...],
) -> tuple[Tensor, _Gradients]:
    """``sum(coef * loss)`` and its gradients in one pass over row chunks of the whole vocab.

    Per chunk of rows: ``x = h_rows @ w^T + b`` (``[c, v]``), its log-sum-exp and target
    logit, then the logits' gradient in ``x``'s own buffer, multiplied into the gradients at
    once: three products, nothing computed twice. With ``e = exp(x - shift)`` and ``total``
    its row sums,

        dL/dx = coef * (e / total - onehot) = scale * (e - total * onehot),  scale = coef / total

    and the per-row ``scale`` goes into the products' small operands (``[c, h]``) rather
    than through the ``[c, v]`` chunk: ``dL/dh_rows = scale * (dx' @ w)``,
    ``dL/dw += dx'^T @ (scale * h_rows)``, ``dL/db += dx'^T @ scale``.
    """
    device, dtype = weight.device, hidden.dtype
    num_rows = hidden.size(0) if index is None else index.numel()
    rows_shape = (num_rows, hidden.size(1))
    # Every row chunk writes its own rows of the hidden-state gradient, and the first one
    # writes the whole [v, h] weight gradient (in the accumulation dtype) that the others
    # add to: neither needs zeroing first, unless no row is computed at all.
    grad_rows = torch.empty(rows_shape, dtype=acc, device=device) if needs[0] else None
    grad_weight = torch.empty(weight.shape, dtype=acc, device=device) if needs[1] else None
    if grad_weight is not None and num_rows == 0:
        grad_weight.zero_()
    grad_bias = None
    if needs[2] and bias is not None:
        grad_bias = torch.zeros(weight.size(0), dtype=acc, device=device)
    need_any = needs[0] or needs[1] or grad_bias is not None
    vocab = (0, weight.size(0))
    loss_sum = torch.zeros((), dtype=acc, device=device)
    for number, rows in enumerate(row_chunks(num_rows, chunk_rows, hidden.size(0))):
        first = number == 0
        # The selected rows are gathered a chunk at a time, never all at once.
        part = hidden[rows[0] : rows[1]] if index is None else hidden[index[rows[0] : rows[1]]]
        c = coef[rows[0] : rows[1]]
        local = sharded.local[rows[0] : rows[1]]
        x = _chunk_logits(part, weight, bias, vocab, acc)
        target_logit = x.gather(1, local).squeeze(1)
        shift = x.amax(dim=1)
        # A row of -inf (or +inf) keeps logsumexp's answer instead of inf - inf = NaN.
        shift = torch.where(shift.isfinite(), shift, 0)
        x.sub_(shift.unsqueeze(1)).exp_()
        total = x.sum(dim=1)
        in_vocab = sharded.in_vocab[rows[0] : rows[1]]
        loss = torch.where(in_vocab, total.log() + shift - target_logit, torch.nan)
        # `where`, not a product: whatever an unweighted row holds must not reach the sum.
        loss_sum += torch.where(c != 0, c * loss, 0).sum()
        if not need_any:
            continue
        scale = torch.where(c != 0, c / total, 0)
        hit = total * sharded.in_shard[rows[0] : rows[1]]
        x.scatter_add_(1, local, -hit.unsqueeze(1))
        if grad_bias is not None:
            grad_bias.addmv_(x.t(), scale)
        dx = x.to(dtype)
        if grad_rows is not None:
            out = grad_rows[rows[0] : rows[1]]
            if dtype == acc:
                torch.mm(dx, weight, out=out)
            else:
                out.copy_(dx @ weight)
            out.mul_(scale.unsqueeze(1))
        if grad_weight is not None:
            scaled = (part.to(acc) * scale.unsqueeze(1)).to(dtype)
            if dtype != acc and first:
                grad_weight.copy_(dx.t() @ scaled)
            elif dtype != acc:
                grad_weight += dx.t() @ scaled
            elif first:
                torch.mm(dx.t(), scaled, out=grad_weight)
            else:
                grad_weight.addmm_(dx.t(), scaled)
    return loss_sum, _Gradients(grad_rows, grad_weight, grad_bias)


class _LinearCrossEntropyTokenLosses(torch.autograd.Function):
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
        acc = accumulation_dtype(hidden.dtype)
        index = selection.index
        rows_hidden = hidden if index is None else hidden.index_select(0, index)
        sharded = shard_targets(targets, weight.size(0), tp_group)
        plan = _Chunks(rows_hidden.size(0), weight.size(0), *chunks, hidden.size(0))
        lse, target_logit = _shard_logsumexp(
            rows_hidden, weight, bias, sharded, plan, acc, tp_group
        )
        losses, scored = scatter_row_losses(
            lse, target_logit, sharded, scored, selection, hidden.size(0)
        )
        ctx.chunks, ctx.positions = chunks, hidden.size(0)
        ctx.save_for_backward(
            rows_hidden,
            weight,
            bias,
            lse,
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
        # dL/dx_r = coef_r * (softmax(x_r) - onehot(target_r)), on scored rows only.
        coef = row_coefficients(grad_losses, lse.dtype, index, scored, overflow)
        plan = _Chunks(rows_hidden.size(0), weight.size(0), *ctx.chunks, ctx.positions)
        needs = ctx.needs_input_grad[:3]
        grads = _softmax_gradients(
            rows_hidden, weight, bias, lse, local, in_shard, coef, plan, needs
        )
        return (
            *_input_gradients(grads, rows_hidden.dtype, index, ctx.positions),
            None, None, None, None, None,
        )  # fmt: skip


def _input_gradients(
    grads: _Gradients,
    dtype: torch.dtype,
    index: Tensor | None,
    positions: int,
    scale: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(hidden, weight, bias)`` gradients in the inputs' dtype, times ``scale`` if given.

    ``grads`` is consumed: where the accumulation dtype is the inputs', its buffers are
    scaled in place and returned.
    """
    out = []
    for grad in grads:
        if grad is not None:
            if scale is not None:
                grad = grad.mul_(scale) if grad.dtype == dtype else grad * scale
            grad = grad.to(dtype)
        out.append(grad)
    grad_rows, grad_weight, grad_bias = out
    if grad_rows is not None and index is not None:
        grad_hidden = grad_rows.new_zeros(positions, grad_rows.size(1))
        grad_rows = grad_hidden.index_copy_(0, index, grad_rows)
    return grad_rows, grad_weight, grad_bias


class _LinearCrossEntropyWeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        coef: Tensor,
        index: Tensor | None,
        overflow: Tensor | None,
        chunks: tuple[int, int],
        single_pass: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        """0-dim ``sum(coef * loss)`` over the selected rows; the gradients are kept for backward.

        ``targets`` and ``coef`` are ``[rows]`` (``coef`` in the accumulation dtype, 0 on
        unweighted rows), aligned with ``index``.
        """
        acc = coef.dtype
        sharded = shard_targets(targets, weight.size(0), tp_group)
        poison = None
        if overflow is not None:
            # More scored rows than selected: the sum and every gradient are NaN.
            poison = torch.where(overflow.any(), torch.nan, 1.0).to(acc)
            coef = coef * poison
        needs = ctx.needs_input_grad[:3]
        if single_pass:
            loss_sum, grads = _single_pass(
                hidden, index, weight, bias, sharded, coef, chunks[0], acc, needs
            )
        else:
            rows_hidden = hidden if index is None else hidden.index_select(0, index)
            plan = _Chunks(rows_hidden.size(0), weight.size(0), *chunks, hidden.size(0))
            lse, target_logit = _shard_logsumexp(
                rows_hidden, weight, bias, sharded, plan, acc, tp_group
            )
            loss = row_losses(lse, target_logit, sharded.in_vocab)
            loss_sum = torch.where(coef != 0, coef * loss, 0).sum()
            grads = _Gradients(None, None, None)
            if any(needs):
                grads = _softmax_gradients(
                    rows_hidden, weight, bias, lse, sharded.local, sharded.in_shard, coef, plan,
                    needs,
                )  # fmt: skip
        if poison is not None:
            loss_sum = loss_sum * poison
        ctx.positions, ctx.dtype = hidden.size(0), hidden.dtype
        ctx.save_for_backward(*grads, index, poison)
        return loss_sum

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_sum: Tensor) -> tuple[Tensor | None, ...]:
        # The loss is linear in what the forward accumulated: scale, no recomputation.
        grad_rows, grad_weight, grad_bias, index, poison = ctx.saved_tensors
        scale = grad_sum.to(accumulation_dtype(ctx.dtype))
        if poison is not None:
            scale = scale * poison
        grads = _Gradients(grad_rows, grad_weight, grad_bias)
        return (
            *_input_gradients(grads, ctx.dtype, index, ctx.positions, scale),
            None, None, None, None, None, None, None,
        )  # fmt: skip


def _check_shapes(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    bias: Tensor | None,
    layout: Layout,
    sequence_parallel: bool,
    tp_size: int,
    mask_name: str,
) -> None:
    check_layout(layout)
    if labels.dim() != 2 or loss_mask.shape != labels.shape:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} and {mask_name} of shape "
            f"{tuple(loss_mask.shape)} must both be [b, s]."
        )
    batch_size, seq_len = labels.shape
    if sequence_parallel:
        seq_len //= tp_size
    expected = (seq_len, batch_size) if layout == "sb" else (batch_size, seq_len)
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
    check_same_device(loss_mask, labels, (mask_name, "labels"))
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


class _HeadRows(NamedTuple):
    """The flat rows one call computes.

    Attributes:
        hidden: ``[positions, h]`` hidden states in memory order (gathered under sequence
            parallelism).
        targets: int64 ``[rows]`` target ids of the selected rows.
        per_row: ``[rows]`` values of the per-position tensor given (mask or weights).
        selection: The :class:`~bert_reduce._vocab_parallel.RowSelection`.
        chunks: ``(chunk_rows, chunk_vocab)``.
    """

    hidden: Tensor
    targets: Tensor
    per_row: Tensor
    selection: RowSelection
    chunks: tuple[int, int]


def _head_rows(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    per_position: Tensor,
    bias: Tensor | None,
    capacity: Capacity,
    num_scored: NumScored | None,
    layout: Layout,
    sequence_parallel: bool,
    chunks: tuple[int | None, int | None],
    tp_group: dist.ProcessGroup | None,
    mask_name: str,
) -> _HeadRows:
    """Check the arguments and choose the rows: everything the two entry points share.

    ``chunks`` defaults: ``chunk_vocab = min(v, 4096)`` and about 2**21 logits per chunk.
    """
    if sequence_parallel and layout != "sb":
        raise ValueError("sequence_parallel=True needs layout='sb' (Megatron's [s/tp, b, h]).")
    _, tp_size, _ = tensor_parallel_placement(tp_group)
    _check_shapes(
        hidden, weight, labels, per_position, bias, layout, sequence_parallel, tp_size, mask_name
    )
    if sequence_parallel:
        hidden = _gather_sequence_parallel(hidden, tp_group)
    chunk_rows, chunk_vocab = chunks
    chunk_vocab = min(weight.size(0), _CHUNK_VOCAB) if chunk_vocab is None else chunk_vocab
    chunk_rows = max(1, _CHUNK_ELEMENTS // chunk_vocab) if chunk_rows is None else chunk_rows
    if chunk_rows < 1 or chunk_vocab < 1:
        raise ValueError(
            f"chunk_rows and chunk_vocab must be positive, got {chunk_rows} and {chunk_vocab}."
        )
    # Flat row r follows hidden's memory order: r = i_s * b + i_b ("sb"), i_b * s + i_s ("bs").
    targets, per_row, selection = flat_rows(
        labels, per_position, layout == "sb", capacity, num_scored
    )
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    return _HeadRows(flat_hidden, targets, per_row, selection, (chunk_rows, chunk_vocab))


def linear_cross_entropy_token_losses(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    *,
    bias: Tensor | None = None,
    layout: Layout = "sb",
    sequence_parallel: bool = False,
    capacity: Capacity = "nonzero",
    num_scored: NumScored | None = None,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Hidden states, output weight, ``[b, s]`` labels and mask -> ``[b, s]`` cross-entropy.

    The per-token cross-entropy of ``F.linear(hidden, weight, bias)``, on the scored rows
    only; 0 on the others.

    Equal (up to rounding) to ``cross_entropy_token_losses(F.linear(hidden, weight, bias), labels,
    loss_mask)`` with the same gradients w.r.t. ``hidden``, ``weight`` and ``bias``, while
    computing only the selected rows' logits, a chunk at a time: the ``[s, b, v]`` logits and
    their gradient never exist. Unscored positions get loss 0 and no gradient.

    The per-token losses may be weighted by the caller in any way, so the backward
    recomputes each chunk's logits (four products per row). When the losses are only summed
    with weights known in the forward (every normalization mode),
    :func:`linear_cross_entropy_loss_sum` (or :func:`linear_cross_entropy_weighted_sum`) does
    three and is faster: this function is for a caller that needs each token's loss.

    Which rows are computed, and when that costs a host sync: ``docs/fast_path.md``. With
    ``capacity="all"`` every row's logits are computed twice (4/3 of the dense head's
    products).

    Under tensor parallelism ``weight`` and ``bias`` are this rank's contiguous vocab shard
    (rank ``r`` holds ids ``[r * v, (r + 1) * v)``), the forward runs ONE all-reduce, and, as
    with ``F.linear`` on the shard, the gradient w.r.t. a replicated ``hidden`` is this
    shard's part: sum it over the TP group as Megatron's ``ColumnParallelLinear`` does (pass
    ``hidden`` through ``copy_to_tensor_model_parallel_region``). With
    ``sequence_parallel=True``, ``hidden`` is this rank's ``[s / tp, b, h]`` sequence shard:
    it is all-gathered, and its gradient reduce-scattered, by Megatron-Core's own mapping
    (the gradient is then whole).

    Args:
        hidden: ``[s, b, h]`` hidden states (``layout="sb"``, Megatron) or ``[b, s, h]``
            (``layout="bs"``, Hugging Face), any float dtype.
        weight: ``[v, h]`` output-layer weight (this rank's vocab shard under TP).
        labels: ``[b, s]`` integer token ids; unscored positions may hold anything.
        loss_mask: ``[b, s]`` bool, integer or float; non-zero entries are scored.
        bias: ``[v]`` output-layer bias, or ``None``.
        layout: ``"sb"`` or ``"bs"``, the layout of ``hidden``.
        sequence_parallel: ``hidden`` is Megatron's sequence-parallel shard (``"sb"`` only).
        capacity: Which rows are computed: ``"nonzero"`` (default; counted, one host sync),
            ``"all"``, a row count or a fraction of ``b * s`` (``docs/fast_path.md``).
        num_scored: The data pipeline's count of scored positions
            (:data:`~bert_reduce.num_scored.NumScored`): exactly that many rows, no host sync
            when it is on the host; overrides ``capacity``. Under ``torch.compile`` pass one
            ``int`` (``docs/fast_path.md``).
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
            ``sequence_parallel`` with ``"bs"``.
        TypeError: On a ``num_scored`` that is neither an ``int`` nor an integer tensor.
    """
    rows = _head_rows(
        hidden, weight, labels, loss_mask, bias, capacity, num_scored, layout,
        sequence_parallel, (chunk_rows, chunk_vocab), tp_group, "loss_mask",
    )  # fmt: skip
    losses = _LinearCrossEntropyTokenLosses.apply(
        rows.hidden, weight, bias, rows.targets, rows.per_row != 0, rows.selection, rows.chunks,
        tp_group,
    )  # fmt: skip
    batch_size, seq_len = labels.shape
    if layout == "sb":
        return losses.view(seq_len, batch_size).t().contiguous()
    return losses.view(batch_size, seq_len)


def linear_cross_entropy_weighted_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_weights: Tensor,
    *,
    bias: Tensor | None = None,
    layout: Layout = "sb",
    sequence_parallel: bool = False,
    capacity: Capacity = "nonzero",
    num_scored: NumScored | None = None,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Hidden states, output weight, labels and ``[b, s]`` weights -> 0-dim weighted loss sum.

    ``sum(token_weights * cross_entropy(F.linear(hidden, weight, bias), labels))``, fused.

    Equal (up to rounding) to ``(token_weights * linear_cross_entropy_token_losses(hidden, weight,
    labels, token_weights != 0, ...)).sum()``, gradients included, but faster: the weights are
    known in the forward, so the gradients w.r.t. ``hidden``, ``weight`` and ``bias`` are
    accumulated during the forward, chunk by chunk, and the backward only scales them by the
    upstream gradient (Liger's fused linear cross-entropy does the same for a scalar loss):
    three products per row, no logits recomputed, extra memory a chunk of ``[rows, v]`` logits.
    :func:`bert_reduce.normalization.normalization_weights` gives the weights and denominator
    of every normalization mode, which is what :func:`linear_cross_entropy_loss_sum` (every
    integration's call) does.

    Which rows are computed, and when that costs a host sync: ``docs/fast_path.md``. With
    ``capacity="all"`` this does the dense head's three products for every row, without its
    logits.

    Passes. On one process with ``chunk_vocab=None`` each chunk of ``chunk_rows`` rows spans
    the whole vocabulary (default ``2**22 / v`` rows, at least one): its logits, their
    log-sum-exp, and their gradient are computed in one buffer. Under tensor parallelism a
    row's softmax needs the log-sum-exp of every vocab shard before any gradient term, so the
    rows are passed over twice: once for the per-row (log-sum-exp, target logit), combined in
    ONE all-reduce, then again for the gradients (four products per row instead of three, as
    :func:`linear_cross_entropy_token_losses`, but all in the forward). A ``chunk_vocab`` smaller
    than ``v`` also takes the two passes, in ``[chunk_rows, chunk_vocab]`` chunks (less
    memory for a very large vocabulary). Tensor and sequence parallelism as in
    :func:`linear_cross_entropy_token_losses`.

    Memory: the gradients are computed in the forward and held until the backward: ``[rows,
    h]`` for the selected rows and ``[v, h]`` for the weight, in fp32 for bf16/fp16 inputs
    (on one process the weight's is whole in fp32 then; two passes accumulate it a
    vocabulary chunk at a time), the input dtype otherwise. In fp32/fp64 the backward scales
    them in place and returns them, so a second backward through the same graph raises
    PyTorch's in-place modification error. Nothing is computed for an input that does not
    require grad, and only the sum under ``torch.no_grad()`` (validation).

    Args:
        hidden: ``[s, b, h]`` hidden states (``layout="sb"``) or ``[b, s, h]`` (``"bs"``).
        weight: ``[v, h]`` output-layer weight (this rank's vocab shard under TP).
        labels: ``[b, s]`` integer token ids; positions of weight 0 may hold anything.
        token_weights: ``[b, s]`` float coefficient of each token's loss; 0 where unscored.
            A NaN weight makes the sum and the gradients NaN.
        bias: ``[v]`` output-layer bias, or ``None``.
        layout: ``"sb"`` or ``"bs"``, the layout of ``hidden``.
        sequence_parallel: ``hidden`` is Megatron's sequence-parallel shard (``"sb"`` only).
        capacity: Which rows are computed, as in :func:`linear_cross_entropy_token_losses`; scored
            means a non-zero weight.
        num_scored: The data pipeline's count of scored positions (at least the number of
            non-zero weights), as in :func:`linear_cross_entropy_token_losses`.
        chunk_rows: Rows per chunk (``None``: about 2**22 logits per chunk in one pass, 2**21
            in two).
        chunk_vocab: ``None`` (default): the whole vocabulary (shard) per chunk on one process
            (one pass), ``min(v, 4096)`` under tensor parallelism; smaller: two passes.
        tp_group: As in :func:`linear_cross_entropy_token_losses`.

    Returns:
        The 0-dim weighted sum in fp32 (fp64 for fp64 inputs), carrying the gradients: NaN
        when a weighted label is outside the vocabulary, and (with the gradients) when more
        positions are scored than the capacity (or ``num_scored``) allows.

    Raises:
        ValueError: As :func:`linear_cross_entropy_token_losses`, or on ``token_weights`` that are
            not floating point.
        TypeError: On a ``num_scored`` that is neither an ``int`` nor an integer tensor.
    """
    if not token_weights.dtype.is_floating_point:
        raise ValueError(
            f"token_weights must be floating-point coefficients, got {token_weights.dtype}; "
            "for a bool or integer mask pass loss_mask.float() or use "
            "bert_reduce.normalization.normalization_weights."
        )
    _, tp_size, _ = tensor_parallel_placement(tp_group)
    single_pass = tp_size == 1 and (chunk_vocab is None or chunk_vocab >= weight.size(0))
    if single_pass:
        vocab = weight.size(0)
        chunk_vocab = vocab
        if chunk_rows is None:
            chunk_rows = max(1, _SINGLE_PASS_ELEMENTS // max(1, vocab))
    rows = _head_rows(
        hidden, weight, labels, token_weights, bias, capacity, num_scored, layout,
        sequence_parallel, (chunk_rows, chunk_vocab), tp_group, "token_weights",
    )  # fmt: skip
    coef = rows.per_row.to(accumulation_dtype(hidden.dtype))
    return _LinearCrossEntropyWeightedSum.apply(
        rows.hidden, weight, bias, rows.targets, coef, rows.selection.index,
        rows.selection.overflow, rows.chunks, single_pass, tp_group,
    )  # fmt: skip


def linear_cross_entropy_loss_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    normalization: Normalization | str = Normalization.PER_TOKEN,
    *,
    bias: Tensor | None = None,
    layout: Layout = "sb",
    capacity: Capacity = "nonzero",
    num_scored: NumScored | None = None,
    sequence_weight: Tensor | None = None,
    sequence_start: Tensor | None = None,
    constant_per_sequence: int | None = None,
    weight_resolution: int | None = None,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """Hidden states, output weight, ``[b, s]`` labels and mask -> ``(loss_sum, denominator)``.

    The fused head's counterpart of :func:`bert_reduce.cross_entropy_loss_sum`: equal (up to
    rounding, gradients included) to ``cross_entropy_loss_sum(F.linear(hidden, weight, bias),
    labels, loss_mask, normalization, ...)``, without the ``[s, b, v]`` logits. The mode's
    per-token weights and denominator come from
    :func:`bert_reduce.normalization.normalization_weights` before any loss, so
    :func:`linear_cross_entropy_weighted_sum` accumulates the gradients in the forward (three
    products per scored row, none recomputed). The call
    :class:`bert_reduce.BERTMLMLossWithReduction`, :class:`bert_reduce.GlobalBatchLoss` and
    :class:`bert_reduce.hf.ExactMLMTrainer` make on hidden states.

    Args:
        hidden: ``[s, b, h]`` hidden states (``layout="sb"``) or ``[b, s, h]`` (``"bs"``).
        weight: ``[v, h]`` output-layer weight (this rank's vocab shard under TP).
        labels: ``[b, s]`` integer token ids; unscored positions may hold anything.
        loss_mask: ``[b, s]`` bool, integer or float; non-zero entries are scored, float
            entries weight them.
        normalization: ``"per_token"`` (default), ``"per_sequence"`` or ``"constant"``; see
            :func:`bert_reduce.normalization.token_loss_sum`.
        bias: ``[v]`` output-layer bias, or ``None``.
        layout: ``"sb"`` or ``"bs"``, the layout of ``hidden``.
        capacity: Which rows are computed (default ``"nonzero"``: the scored rows, counted with
            one host sync on an accelerator); see :func:`linear_cross_entropy_token_losses`.
        num_scored: The data pipeline's count of scored positions: exactly that many rows, no
            sync; see :func:`linear_cross_entropy_token_losses`.
        sequence_weight: As in :func:`bert_reduce.normalization.token_loss_sum`.
        sequence_start: As in :func:`bert_reduce.normalization.token_loss_sum`.
        constant_per_sequence: As in :func:`bert_reduce.normalization.token_loss_sum`.
        weight_resolution: As in :func:`bert_reduce.normalization.token_loss_sum`.
        chunk_rows: As in :func:`linear_cross_entropy_weighted_sum`.
        chunk_vocab: As in :func:`linear_cross_entropy_weighted_sum`.
        tp_group: As in :func:`linear_cross_entropy_token_losses`.

    Returns:
        ``(loss_sum, denominator)``: the mode's 0-dim numerator in fp32 (fp64 for fp64
        inputs) carrying the gradients (NaN on an out-of-vocabulary scored label or a capacity
        overflow), and its 0-dim denominator, as :func:`bert_reduce.normalization.token_loss_sum`
        returns it.

    Raises:
        ValueError: As :func:`linear_cross_entropy_weighted_sum` and
            :func:`bert_reduce.normalization.token_loss_sum`.
        TypeError: On a ``num_scored`` that is neither an ``int`` nor an integer tensor.
    """
    token_weights, denominator = normalization_weights(
        loss_mask,
        normalization,
        dtype=accumulation_dtype(hidden.dtype),
        sequence_weight=sequence_weight,
        sequence_start=sequence_start,
        constant_per_sequence=constant_per_sequence,
        weight_resolution=weight_resolution,
    )
    loss_sum = linear_cross_entropy_weighted_sum(
        hidden,
        weight,
        labels,
        token_weights,
        bias=bias,
        capacity=capacity,
        num_scored=num_scored,
        layout=layout,
        chunk_rows=chunk_rows,
        chunk_vocab=chunk_vocab,
        tp_group=tp_group,
    )
    return loss_sum, denominator
