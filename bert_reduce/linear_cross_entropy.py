"""Masked-only language-model head: the output projection and the cross-entropy, fused.

These functions compute the logits of the selected rows only, a chunk at a time (the kernels:
:mod:`bert_reduce._fused_head`). Which rows are computed, and when that costs a host sync:
``docs/fast_path.md``; why, precision, memory, passes and tensor parallelism:
``docs/performance.md``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from bert_reduce import _fused_head
from bert_reduce._fused_head import compile_bucket
from bert_reduce._vocab_parallel import Capacity
from bert_reduce.forward_output import Layout
from bert_reduce.functional import accumulation_dtype
from bert_reduce.normalization import Normalization, normalization_weights
from bert_reduce.num_scored import NumScored

__all__ = [
    "compile_bucket",
    "linear_cross_entropy_loss_sum",
    "linear_cross_entropy_token_losses",
    "linear_cross_entropy_weighted_sum",
]


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

    Equal (up to rounding) to ``cross_entropy_token_losses(F.linear(hidden, weight, bias), labels,
    loss_mask)`` with the same gradients w.r.t. ``hidden``, ``weight`` and ``bias``; the
    ``[s, b, v]`` logits and their gradient never exist. Unscored positions get loss 0 and no
    gradient; the backward recomputes each chunk's logits. Under tensor parallelism the
    gradient w.r.t. a replicated ``hidden`` is this shard's part, to be summed over the group,
    and a sequence-parallel shard's is whole (as Megatron's mappings do: ``docs/megatron.md``).

    Args:
        hidden: ``[s, b, h]`` hidden states (``layout="sb"``, Megatron) or ``[b, s, h]``
            (``layout="bs"``, Hugging Face), any float dtype.
        weight: ``[v, h]`` output-layer weight; under TP this rank's contiguous vocab shard
            (ids ``[r * v, (r + 1) * v)``), as ``bias`` is.
        labels: ``[b, s]`` integer token ids; unscored positions may hold anything.
        loss_mask: ``[b, s]`` bool, integer or float; non-zero entries are scored.
        bias: ``[v]`` output-layer bias, or ``None``.
        layout: ``"sb"`` or ``"bs"``, the layout of ``hidden``.
        sequence_parallel: ``hidden`` is Megatron's sequence-parallel shard (``"sb"`` only).
        capacity: Which rows are computed: ``"nonzero"`` (default; counted, one host sync),
            ``"all"``, a row count or a fraction of ``b * s`` (``docs/fast_path.md``).
        num_scored: The data pipeline's count of scored positions
            (:data:`~bert_reduce.num_scored.NumScored`), which overrides ``capacity``.
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
    rows = _fused_head.head_rows(
        hidden, weight, labels, loss_mask, bias, capacity, num_scored, layout,
        sequence_parallel, (chunk_rows, chunk_vocab), tp_group, "loss_mask",
    )  # fmt: skip
    losses = _fused_head.TokenLosses.apply(rows.hidden, weight, bias, rows, tp_group)
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

    ``sum(token_weights * cross_entropy(F.linear(hidden, weight, bias), labels))``: equal (up to
    rounding, gradients included) to ``(token_weights * linear_cross_entropy_token_losses(hidden,
    weight, labels, token_weights != 0, ...)).sum()``, but with the gradients computed in the
    forward, which the backward only scales (passes, memory: ``docs/performance.md``).

    Args:
        hidden: As in :func:`linear_cross_entropy_token_losses`.
        weight: As in :func:`linear_cross_entropy_token_losses`.
        labels: ``[b, s]`` integer token ids; positions of weight 0 may hold anything.
        token_weights: ``[b, s]`` float coefficient of each token's loss; 0 where unscored.
            A NaN weight makes the sum and the gradients NaN.
        bias: As in :func:`linear_cross_entropy_token_losses`.
        layout: As in :func:`linear_cross_entropy_token_losses`.
        sequence_parallel: As in :func:`linear_cross_entropy_token_losses`.
        capacity: As in :func:`linear_cross_entropy_token_losses`; scored: a non-zero weight.
        num_scored: As in :func:`linear_cross_entropy_token_losses`.
        chunk_rows: Rows per chunk (``None``: the chunk sizes of ``docs/performance.md``).
        chunk_vocab: ``None`` (default): the whole vocabulary (shard) per chunk on one process
            (one pass), ``min(v, 4096)`` under tensor parallelism; smaller: two passes.
        tp_group: As in :func:`linear_cross_entropy_token_losses`.

    Returns:
        The 0-dim weighted sum in fp32 (fp64 for fp64 inputs), carrying the gradients; NaN as
        :func:`linear_cross_entropy_token_losses`' losses are.

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
    rows = _fused_head.head_rows(
        hidden, weight, labels, token_weights, bias, capacity, num_scored, layout,
        sequence_parallel, (chunk_rows, chunk_vocab), tp_group, "token_weights", one_pass=True,
    )  # fmt: skip
    return _fused_head.WeightedSum.apply(rows.hidden, weight, bias, rows, tp_group)


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

    Equal (up to rounding, gradients included) to ``cross_entropy_loss_sum(F.linear(hidden,
    weight, bias), labels, loss_mask, normalization, ...)``, without the ``[s, b, v]`` logits:
    :func:`linear_cross_entropy_weighted_sum` with the weights of
    :func:`bert_reduce.normalization.token_loss_sum`'s mode; the arguments are theirs.

    Returns:
        ``(loss_sum, denominator)``: the 0-dim weighted sum of
        :func:`linear_cross_entropy_weighted_sum` and the mode's 0-dim denominator, as
        :func:`bert_reduce.normalization.token_loss_sum` returns them.

    Raises:
        ValueError, TypeError: As :func:`linear_cross_entropy_weighted_sum` and
            :func:`bert_reduce.normalization.token_loss_sum`.
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
