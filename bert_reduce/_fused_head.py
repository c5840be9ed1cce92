"""(Private) The fused head's kernels: input checks, chunk planning, the two autograd functions.

Each ``[rows, vocab]`` chunk of the selected rows' logits ``x = h_rows @ w^T + b`` becomes its
gradient ``dL/dx = coef * (softmax - onehot)`` at once, in **one pass** (:func:`gradient_pass`
without ``lse``) or **two** (:func:`stats_pass`, then :func:`gradient_pass` with the global
log-sum-exp; when and why: ``docs/performance.md``). With ``p`` the chunk's softmax up to a
per-row factor ``1 / q`` (one pass: the softmax over the row and its maximum,
:func:`_softmax_minus_onehot_`; two passes: ``exp(x - lse)``, ``q = 1``),

    dL/dx = coef * (p / q - onehot) = scale * (p - q * onehot),  scale = coef / q

and the per-row ``scale`` goes into the products' small operands (``[c, h]``) rather than
through the ``[c, v]`` chunk: ``dL/dh_rows = scale * (dx' @ w)``,
``dL/dw += dx'^T @ (scale * h_rows)``, ``dL/db += dx'^T @ scale``.
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
    gather_sequence_parallel,
    logsumexp_,
    row_coefficients,
    row_losses,
    scatter_losses,
    shard_targets,
    tensor_parallel_placement,
)
from bert_reduce.forward_output import Layout, check_layout
from bert_reduce.functional import (
    accumulation_dtype,
    check_same_device,
    check_same_shape,
    check_token_tensor,
)
from bert_reduce.num_scored import NumScored

_CHUNK_ELEMENTS = 1 << 21
_CHUNK_VOCAB = 4096
# One pass holds a row chunk's logits over the whole vocabulary, in one buffer reused by every
# chunk. Each product call re-packs the whole weight, so larger chunks keep the products
# efficient: on one CPU thread, a 512-wide head's three products in chunks of 240-320 rows ran
# within 1% of one call on all rows, 4% slower in chunks of 160, 29% in chunks of 80; 32 MiB
# (4 chunks at the Geneformer-like shape) ran ~1% faster than 24 MiB (5 chunks).
_SINGLE_PASS_BYTES = 32 << 20
# In reduced precision the weight gradient's (high, low) pair (:class:`Gradients`) already
# holds one [v, h] beyond the returned gradient: 6 MiB chunks keep the step's extra memory
# within 0.1x the bf16 logits (Geneformer-like shape), and the bf16 products are fast enough
# to afford the smaller chunks (bf16 steps stay faster than fp32 ones).
_REDUCED_PASS_BYTES = 6 << 20
# The pair is summed in fp32 a slice of this many vocabulary rows at a time (3 MiB of
# temporaries at h = 512).
_PAIR_SLICE = 1024
# Reduced-precision chunks are converted in blocks of rows of about 2**18 values (1 MiB of
# fp32), which stay in a core's L2 cache between the passes over them.
_BLOCK_ELEMENTS = 1 << 18

COMPILE_BUCKETS = 16


def compile_bucket(count: int, positions: int) -> int:
    """``count`` rounded up to a multiple of ``ceil(positions / 16)``, at most ``positions``.

    Under ``torch.compile`` :func:`row_chunks` counts chunks from this bucket, one graph per
    bucket (``docs/fast_path.md``): dynamo compiles the first count as a constant, then makes
    it a dynamic integer whose guards only compare it with the bucket's bounds.
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


class Plan(NamedTuple):
    """Row and vocabulary chunks of one call: ``[start, end)`` pairs."""

    rows: list[tuple[int, int]]
    vocab: list[tuple[int, int]]


def _hit_in_chunk(
    local: Tensor, in_shard: Tensor, rows: tuple[int, int], vocab: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Each row's ``[c, 1]`` column in a vocab chunk (0 if elsewhere), and ``[c]`` whether there."""
    column = local[rows[0] : rows[1]] - vocab[0]
    inside = (column >= 0) & (column < vocab[1] - vocab[0])
    inside &= in_shard[rows[0] : rows[1]].unsqueeze(1)
    return torch.where(inside, column, 0), inside.squeeze(1)


def stats_pass(
    rows_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    sharded: ShardedTargets,
    plan: Plan,
    acc: torch.dtype,
    tp_group: dist.ProcessGroup | None,
) -> tuple[Tensor, Tensor]:
    """Every row's global ``(log-sum-exp, loss)``, ``[rows]`` each: ONE all-reduce."""
    _, tp_size, tp_rank = tensor_parallel_placement(tp_group)
    stats = torch.zeros(tp_size, 2, rows_hidden.size(0), dtype=acc, device=rows_hidden.device)
    lse, target_logit = stats[tp_rank, 0], stats[tp_rank, 1]
    lse.fill_(-torch.inf)
    for rows in plan.rows:
        for vocab in plan.vocab:
            b = None if bias is None else bias[vocab[0] : vocab[1]]
            # Fresh [c, v_chunk] logits in acc, for logsumexp_ to overwrite.
            x = F.linear(rows_hidden[rows[0] : rows[1]], weight[vocab[0] : vocab[1]], b).to(acc)
            column, inside = _hit_in_chunk(sharded.local, sharded.in_shard, rows, vocab)
            target_logit[rows[0] : rows[1]] += torch.where(inside, x.gather(1, column)[:, 0], 0)
            # Online log-sum-exp over vocabulary chunks: lse = log(exp(lse) + sum(exp(x))).
            running = lse[rows[0] : rows[1]]
            torch.logaddexp(running, logsumexp_(x), out=running)
    lse, target_logit = combine_shard_stats(stats, sharded, tp_group)
    return lse, row_losses(lse, target_logit, sharded.in_vocab)


class Gradients(NamedTuple):
    """Gradients w.r.t. the ``[rows, h]`` rows, ``[v, h]`` weight and ``[v]`` bias (or ``None``).

    In reduced precision the weight's is a pair of buffers in the input dtype, ``weight`` and
    ``weight_low``, whose fp32 sum is the gradient (16 significant bits for bf16), so that no
    fp32 ``[v, h]`` buffer twice the returned gradient's size is held from forward to backward.
    """

    rows: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    weight_low: Tensor | None = None


def _row_width(columns: int, dtype: torch.dtype) -> int:
    """``columns`` rounded up to whole 64-byte lines.

    The products ran ~2% faster on aligned rows than on rows of ``v + 1`` values (one CPU
    thread, Geneformer-like head).
    """
    align = max(1, 64 // dtype.itemsize)
    return -(-columns // align) * align


def _softmax_minus_onehot_(
    x: Tensor,
    work: Tensor | None,
    column: Tensor,
    inside: Tensor,
    lse: Tensor | None,
    grad_bias: Tensor | None,
    coef: Tensor,
    gradient: bool,
) -> tuple[Tensor | None, Tensor]:
    """Overwrite a ``[c, v_chunk]`` chunk of logits with its gradient up to a per-row scale.

    Returns ``(log_probability, scale)``: the rows' target log-probabilities (one pass, else
    ``None``) and the module docstring's ``[c]`` factor, ``dL/dx = scale * x_after``;
    ``grad_bias += x_after^T @ scale`` when given. ``gradient=False`` only computes the
    log-probabilities. Without the rows' global ``lse`` the chunk spans the whole vocabulary,
    and ONE softmax over the row and one extra column holding the row's maximum ``m`` gives
    everything: with ``S = sum_j exp(x_j - m)``, the softmax over ``[x, m]`` is
    ``p_j = exp(x_j - m) / (S + 1)`` and ``p_last = 1 / (S + 1)``, so that
    (``q = 1 - p_last = S / (S + 1)``, in ``[1/2, 1)``)

        log S = log(q) - log(p_last),  softmax(x) = p / q  (the module docstring's ``q``).

    ``work`` is that buffer, ``[c, width]`` with ``width > v_chunk`` (``x`` is its first
    columns, in the accumulation dtype; the columns past the extra one hold ``-inf``, which
    the softmax ignores, so that it runs over whole rows of a contiguous buffer), or ``None``
    for another dtype: the chunk is then converted a block of rows at a time into one small
    buffer that stays in a core's cache, and written back.
    """
    acc = coef.dtype
    rows, vocab = x.shape
    step = rows
    converted = work is None and (lse is None or x.dtype != acc)
    if converted:
        width = _row_width(vocab + (lse is None), acc)
        if x.dtype != acc and not torch.compiler.is_compiling():
            step = max(1, _BLOCK_ELEMENTS // width)
        work = torch.empty(min(step, rows), width, dtype=acc, device=x.device)
    log_probability = None if lse is not None else torch.empty(rows, dtype=acc, device=x.device)
    scale = coef if lse is not None else torch.empty(rows, dtype=acc, device=x.device)
    for start in [0] if step == rows else range(0, rows, step):
        end = min(start + step, rows)
        block = None if work is None else work[: end - start]
        y = x if block is None else block[:, :vocab]
        if converted:
            y.copy_(x[start:end])
        if lse is not None:
            y.sub_(lse[start:end].unsqueeze(1))
            if gradient:
                y.exp_().scatter_add_(1, column[start:end], -inside[start:end].to(acc)[:, None])
        else:
            top = y.amax(1)
            block[:, vocab] = top
            block[:, vocab + 1 :] = -torch.inf
            target = y.gather(1, column[start:end]).squeeze(1)
            torch.softmax(block, -1, out=block)
            p_last = block[:, vocab]
            q = 1 - p_last
            # log_softmax(x)_t = x_t - m - log S
            log_probability[start:end] = target - top - (q.log() - p_last.log())
            if gradient:
                y.scatter_add_(1, column[start:end], (-q * inside[start:end]).unsqueeze(1))
                scale[start:end] = coef[start:end] / q
        if not gradient:
            continue
        if grad_bias is not None:
            grad_bias.addmv_(y.t(), scale[start:end])
        if converted:
            x[start:end].copy_(y)
    return log_probability, scale


def gradient_pass(
    rows_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    sharded: ShardedTargets,
    coef: Tensor,
    plan: Plan,
    needs: tuple[bool, ...],
    lse: Tensor | None = None,
) -> tuple[Tensor, Gradients]:
    """``sum(coef * loss)`` and the gradients of the needed ``(rows, weight, bias)``.

    Without ``lse`` (one vocabulary chunk, one shard) each chunk's own softmax gives the loss
    and the gradient; with the rows' global ``lse`` the loss is the caller's (0 is returned).
    Vocabulary chunks are the outer loop: the weight's gradient is summed a chunk at a time.
    """
    acc, dtype, device = coef.dtype, rows_hidden.dtype, coef.device
    grad_rows = torch.zeros(rows_hidden.shape, dtype=acc, device=device) if needs[0] else None
    grad_weight = grad_low = None
    if needs[1]:  # set by each vocabulary chunk's first row chunk: zero without one
        alloc = torch.empty if plan.rows else torch.zeros
        grad_weight = alloc(weight.shape, dtype=dtype, device=device)
        grad_low = alloc(weight.shape, dtype=dtype, device=device) if dtype != acc else None
    grad_bias = None
    if needs[2] and bias is not None:
        grad_bias = torch.zeros(weight.size(0), dtype=acc, device=device)
    loss_sum = torch.zeros((), dtype=acc, device=device)
    # One buffer for every chunk's logits (and the extra column of _softmax_minus_onehot_'s
    # `work`): fresh memory per chunk costs page faults (~5% of the step on a CPU). Under
    # torch.compile (which takes no strided `out=`) each chunk is fresh, the compiler's to place.
    compiling = torch.compiler.is_compiling()
    spare = dtype == acc and lse is None and not compiling
    buffer = None
    if not compiling:
        # Balanced chunks (:func:`row_chunks`): the widest has ceil(rows / chunks) rows.
        widest = -(-rows_hidden.size(0) // len(plan.rows)) if plan.rows else 0
        width = _row_width(plan.vocab[0][1] - plan.vocab[0][0] + spare, dtype)
        buffer = torch.empty(widest, width, dtype=dtype, device=device)
    for vocab in plan.vocab:
        w = weight[vocab[0] : vocab[1]]
        b = None if bias is None else bias[vocab[0] : vocab[1]]
        grad_w = None if grad_weight is None else grad_weight[vocab[0] : vocab[1]]
        low = None if grad_low is None else grad_low[vocab[0] : vocab[1]]
        for number, rows in enumerate(plan.rows):
            part, c = rows_hidden[rows[0] : rows[1]], coef[rows[0] : rows[1]]
            work = None
            if buffer is None:
                x = F.linear(part, w, b)
            else:
                work = buffer[: rows[1] - rows[0]]
                x = work[:, : vocab[1] - vocab[0]]
                if b is None:
                    torch.mm(part, w.t(), out=x)
                else:
                    torch.addmm(b, part, w.t(), out=x)
            column, inside = _hit_in_chunk(sharded.local, sharded.in_shard, rows, vocab)
            target, scale = _softmax_minus_onehot_(
                x, work if spare else None, column, inside,
                None if lse is None else lse[rows[0] : rows[1]],
                None if grad_bias is None else grad_bias[vocab[0] : vocab[1]], c, any(needs),
            )  # fmt: skip
            if target is not None:
                loss = row_losses(-target, 0, sharded.in_vocab[rows[0] : rows[1]])
                # `where`, not a product: whatever an unweighted row holds must not reach the sum.
                loss_sum += torch.where(c != 0, c * loss, 0).sum()
            if grad_rows is not None:
                grad_rows[rows[0] : rows[1]].addcmul_(x @ w, scale.unsqueeze(1))
            if grad_w is not None:
                scaled = (part.to(acc) * scale.unsqueeze(1)).to(dtype)
                _add_weight_gradient(grad_w, low, x, scaled, number, acc)
    return loss_sum, Gradients(grad_rows, grad_weight, grad_bias, grad_low)


def _add_weight_gradient(
    grad_w: Tensor, low: Tensor | None, dx: Tensor, scaled: Tensor, number: int, acc: torch.dtype
) -> None:
    """``grad_w (=|+=) dx^T @ scaled``: set by a vocabulary chunk's first row chunk (``number``).

    The product runs in the inputs' dtype, as ``F.linear``'s backward would. In reduced
    precision it is added in ``acc`` to the ``(grad_w, low)`` pair (see :class:`Gradients`) a
    slice of the vocabulary at a time, so that the temporaries stay small.
    """
    if low is None:
        if number == 0:
            torch.mm(dx.t(), scaled, out=grad_w)
        else:
            grad_w.addmm_(dx.t(), scaled)
        return
    for start in range(0, grad_w.size(0), _PAIR_SLICE):
        high, rest = grad_w[start : start + _PAIR_SLICE], low[start : start + _PAIR_SLICE]
        total = (dx[:, start : start + _PAIR_SLICE].t() @ scaled).to(acc)
        if number:
            total += high
            total += rest
        high.copy_(total)
        rest.copy_(total.sub_(high))


def _input_gradients(
    grads: Gradients,
    dtype: torch.dtype,
    scale: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(rows, weight, bias)`` gradients in the inputs' dtype, times ``scale`` if given.

    ``grads`` is consumed: where the accumulation dtype is the inputs', its buffers are scaled
    in place and returned.
    """
    *grads, low = grads
    if low is not None:  # the (high, low) pair: summed in fp32 and scaled, a slice at a time
        high = grads[1]
        for start in range(0, high.size(0), _PAIR_SLICE):
            total = high[start : start + _PAIR_SLICE].float() + low[start : start + _PAIR_SLICE]
            high[start : start + _PAIR_SLICE] = total if scale is None else total.mul_(scale)
    out = []
    for number, grad in enumerate(grads):
        if grad is not None and (low is None or number != 1):
            if scale is not None:
                grad = grad.mul_(scale) if grad.dtype == dtype else grad * scale
            grad = grad.to(dtype)
        out.append(grad)
    return out[0], out[1], out[2]


class TokenLosses(torch.autograd.Function):
    """``[positions]`` losses of the selected ``[rows, h]`` ``hidden``; backward recomputes."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        rows: HeadRows,
        tp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        selection, acc = rows.selection, accumulation_dtype(hidden.dtype)
        lse, loss = stats_pass(hidden, weight, bias, rows.sharded, rows.plan, acc, tp_group)
        losses, scored = scatter_losses(loss, rows.per_row != 0, selection, rows.positions)
        ctx.plan = rows.plan
        ctx.save_for_backward(
            hidden, weight, bias, lse, *rows.sharded, scored, selection.index, selection.overflow
        )
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor | None, ...]:
        rows_hidden, weight, bias, lse, *sharded, scored, index, overflow = ctx.saved_tensors
        # dL/dx_r = coef_r * (softmax(x_r) - onehot(target_r)), on scored rows only.
        coef = row_coefficients(grad_losses, lse.dtype, index, scored, overflow)
        _, grads = gradient_pass(
            rows_hidden, weight, bias, ShardedTargets(*sharded), coef, ctx.plan,
            ctx.needs_input_grad[:3], lse,
        )  # fmt: skip
        return *_input_gradients(grads, rows_hidden.dtype), None, None


class WeightedSum(torch.autograd.Function):
    """0-dim ``sum(coef * loss)``: the forward computes the gradients, the backward scales them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        rows: HeadRows,
        tp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        """``coef``, the rows' weights in the accumulation dtype, 0 on unweighted rows."""
        coef = rows.per_row.to(accumulation_dtype(hidden.dtype))
        sharded, plan = rows.sharded, rows.plan
        poison = None
        if rows.selection.overflow is not None:
            # More scored rows than selected: the sum and every gradient are NaN.
            poison = torch.where(rows.selection.overflow.any(), torch.nan, 1.0).to(coef.dtype)
            coef = coef * poison
        needs = ctx.needs_input_grad[:3]
        if rows.single_pass:
            loss_sum, grads = gradient_pass(hidden, weight, bias, sharded, coef, plan, needs)
        else:
            lse, loss = stats_pass(hidden, weight, bias, sharded, plan, coef.dtype, tp_group)
            loss_sum = torch.where(coef != 0, coef * loss, 0).sum()
            grads = Gradients(None, None, None, None)
            if any(needs):
                _, grads = gradient_pass(hidden, weight, bias, sharded, coef, plan, needs, lse)
        if poison is not None:
            loss_sum = loss_sum * poison
        ctx.dtype = hidden.dtype
        ctx.save_for_backward(*grads, poison)
        return loss_sum

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_sum: Tensor) -> tuple[Tensor | None, ...]:
        # The loss is linear in what the forward accumulated: scale, no recomputation.
        *grads, poison = ctx.saved_tensors
        scale = grad_sum.to(accumulation_dtype(ctx.dtype))
        if poison is not None:
            scale = scale * poison
        return *_input_gradients(Gradients(*grads), ctx.dtype, scale), None, None


class HeadRows(NamedTuple):
    """The rows one call computes (of its flat ``positions``), and its chunks.

    ``hidden`` is the selected rows' ``[rows, h]`` (gathered under sequence parallelism);
    ``sharded`` and ``per_row`` (mask or weights) are theirs.
    """

    hidden: Tensor
    sharded: ShardedTargets
    per_row: Tensor
    selection: RowSelection
    positions: int
    plan: Plan
    single_pass: bool


def head_rows(
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
    one_pass: bool = False,
) -> HeadRows:
    """Check the arguments and choose the rows and chunks (``one_pass``: the weighted sum's)."""
    group, tp_size, _ = tensor_parallel_placement(tp_group)
    check_layout(layout)
    if sequence_parallel and layout != "sb":
        raise ValueError("sequence_parallel=True needs layout='sb' (Megatron's [s/tp, b, h]).")
    shard = ", this rank's sequence shard," if sequence_parallel else ""
    shards = tp_size if sequence_parallel else 1
    check_token_tensor(hidden, labels, "hidden", f"{layout}h", shards, f"{shard} and {layout=}")
    check_same_shape(per_position, labels, (mask_name, "labels"), "[b, s]")
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
    check_same_device(hidden, weight, ("hidden", "weight"))
    check_same_device(per_position, labels, (mask_name, "labels"))
    if bias is not None:
        check_same_device(weight, bias, ("weight", "bias"))
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias "
            f"({None if bias is None else bias.dtype}) must share one dtype, as F.linear needs."
        )
    if sequence_parallel and tp_size > 1:
        hidden = gather_sequence_parallel(hidden, group)
    chunk_rows, chunk_vocab = chunks
    vocab = weight.size(0)
    single_pass = one_pass and tp_size == 1 and (chunk_vocab is None or chunk_vocab >= vocab)
    if single_pass:
        reduced = accumulation_dtype(hidden.dtype) != hidden.dtype
        budget = _REDUCED_PASS_BYTES if reduced else _SINGLE_PASS_BYTES
        chunk_vocab, elements = vocab, budget // hidden.element_size()
    else:
        chunk_vocab = min(vocab, _CHUNK_VOCAB) if chunk_vocab is None else chunk_vocab
        elements = _CHUNK_ELEMENTS
    chunk_rows = max(1, elements // max(1, chunk_vocab)) if chunk_rows is None else chunk_rows
    if chunk_rows < 1 or chunk_vocab < 1:
        raise ValueError(
            f"chunk_rows and chunk_vocab must be positive, got {chunk_rows} and {chunk_vocab}."
        )
    targets, per_row, selection = flat_rows(
        labels, per_position, layout == "sb", capacity, num_scored
    )
    hidden = hidden.reshape(-1, hidden.size(-1))
    positions = hidden.size(0)
    if selection.index is not None:  # autograd scatters the rows' gradient back
        hidden = hidden.index_select(0, selection.index)
    vocab_chunks = [(a, min(a + chunk_vocab, vocab)) for a in range(0, vocab, chunk_vocab)]
    plan = Plan(row_chunks(targets.numel(), chunk_rows, positions), vocab_chunks)
    return HeadRows(
        hidden, shard_targets(targets, vocab, tp_group), per_row, selection, positions, plan,
        single_pass,
    )  # fmt: skip
