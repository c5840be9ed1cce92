"""The fused masked-only LM head under tensor parallelism: 2 real gloo processes, Megatron's TP.

Each rank holds half of the vocabulary (rows of the output weight and bias); the losses (or
their weighted sum) and gradients must equal F.linear + F.cross_entropy on the whole
vocabulary, with ONE collective in the forward. With sequence parallelism each rank holds a
sequence shard of the hidden states too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce import BERTMLMLossWithReduction, linear_cross_entropy_token_losses
from bert_reduce.linear_cross_entropy import linear_cross_entropy_weighted_sum
from tests.helpers.dist_utils import run_distributed
from tests.helpers.megatron_cpu import megatron_on_cpu
from tests.helpers.reference import linear_reference, make_head_batch
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

CHUNKS = {"chunk_rows": 4, "chunk_vocab": 3}
VOCAB, SHARD, SEQ_LEN = 14, 7, 10
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _shard_leaves(hidden, weight, bias, tp_rank: int, hidden_rows=slice(None)) -> list:
    cols = slice(tp_rank * SHARD, (tp_rank + 1) * SHARD)
    leaves = [hidden[hidden_rows].clone(), weight[cols].clone(), bias[cols].clone()]
    return [leaf.requires_grad_(True) for leaf in leaves]


def _check_shard_grads(leaves, reference, tp_rank: int, scale: float = 1.0, hidden_rows=None):
    """The weight's and bias's are this rank's vocab shard of the reference's (times ``scale``).

    The hidden states': on a sequence shard (``hidden_rows``), its rows, whole (Megatron's
    reduce-scatter summed the ranks'); else, as with F.linear on a vocab shard, this rank's
    part, summed over TP ranks (Megatron's copy_to_tensor_model_parallel_region).
    """
    from megatron.core import parallel_state

    cols = slice(tp_rank * SHARD, (tp_rank + 1) * SHARD)
    _, ref_hidden, ref_weight, ref_bias = reference
    torch.testing.assert_close(leaves[1].grad, ref_weight[cols] * scale, **TOL)
    torch.testing.assert_close(leaves[2].grad, ref_bias[cols] * scale, **TOL)
    if hidden_rows is not None:
        torch.testing.assert_close(leaves[0].grad, ref_hidden[hidden_rows] * scale, **TOL)
        return
    hidden_grad = leaves[0].grad.clone()
    dist.all_reduce(hidden_grad, group=parallel_state.get_tensor_model_parallel_group())
    torch.testing.assert_close(hidden_grad, ref_hidden * scale, **TOL)


def _checks(tp_rank: int, sequence_parallel: bool) -> None:
    """The losses, the weighted sum and the loss class; under sequence parallelism (Megatron's
    all-gather and reduce-scatter) each rank holds a sequence shard of the hidden states."""
    half = SEQ_LEN // 2
    rows = slice(tp_rank * half, (tp_rank + 1) * half) if sequence_parallel else None
    hidden, weight, bias, labels, mask = make_head_batch(
        3, SEQ_LEN, 5, VOCAB, mask_prob=0.4, seed=3
    )
    coef = mask * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    reference = linear_reference(hidden, weight, bias, labels, coef)
    counts = mask.sum(dim=1)
    options = {"sequence_parallel": sequence_parallel, **CHUNKS}
    for capacity, num_scored in [("all", None), ("nonzero", None), (0.6, None), (1, counts)]:
        leaves = _shard_leaves(hidden, weight, bias, tp_rank, rows or slice(None))
        with megatron_on_cpu():
            with count_collectives() as calls:
                losses = linear_cross_entropy_token_losses(
                    leaves[0], leaves[1], labels, mask, bias=leaves[2],
                    capacity=capacity, num_scored=num_scored, **options,
                )  # fmt: skip
            (losses * coef).sum().backward()
        if not sequence_parallel:
            assert dict(calls) == {"all_reduce": 1}, (capacity, dict(calls))
        torch.testing.assert_close(losses, reference[0], **TOL)
        _check_shard_grads(leaves, reference, tp_rank, hidden_rows=rows)

    # The weighted sum: gradients accumulated in the forward, after the one all-reduce
    # (two passes over the shard's chunks), scaled by the upstream gradient in backward.
    for capacity, num_scored in [("all", None), (None, None), (0.6, None), (1, int(mask.sum()))]:
        leaves = _shard_leaves(hidden, weight, bias, tp_rank, rows or slice(None))
        rows_option = {} if capacity is None else {"capacity": capacity}
        with megatron_on_cpu(), count_collectives() as calls:
            total = linear_cross_entropy_weighted_sum(
                leaves[0], leaves[1], labels, coef.double(), bias=leaves[2],
                num_scored=num_scored, **rows_option, **options,
            )  # fmt: skip
            (0.5 * total).backward()
        if not sequence_parallel:
            assert dict(calls) == {"all_reduce": 1}, (capacity, dict(calls))
        torch.testing.assert_close(total, (reference[0] * coef).sum(), rtol=1e-10, atol=0)
        _check_shard_grads(leaves, reference, tp_rank, scale=0.5, hidden_rows=rows)
    if sequence_parallel:
        return

    # Through the loss reduction, with the collator's CPU count: one collective, no sync.
    leaves = _shard_leaves(hidden, weight, bias, tp_rank)
    loss_fn = BERTMLMLossWithReduction()
    loss_fn.setup({"labels": labels, "loss_mask": mask, "num_scored": counts})
    forward_out = {"hidden_states": leaves[0], "output_weight": leaves[1], "output_bias": leaves[2]}
    with forbid_host_syncs(), count_collectives() as calls:
        loss_sum, num_tokens, _ = loss_fn(forward_out)
        loss_sum.backward()
    assert dict(calls) == {"all_reduce": 1} and int(num_tokens) == int(mask.sum())
    _check_shard_grads(
        leaves, linear_reference(hidden, weight, bias, labels, mask.double()), tp_rank
    )


def _body() -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for sequence_parallel in (False, True):
        _checks(tp_rank, sequence_parallel)


@pytest.mark.slow
def test_tensor_and_sequence_parallel_two_ranks_match_full_vocab_reference() -> None:
    run_distributed(_body, 2, tp=2)
