"""The fused masked-only LM head under tensor parallelism: 2 real gloo processes, Megatron's TP.

Each rank holds half of the vocabulary (rows of the output weight and bias); the losses (or
their weighted sum) and gradients must equal F.linear + F.cross_entropy on the whole
vocabulary, with ONE collective in the forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce import BERTMLMLossWithReduction, linear_cross_entropy_token_losses
from bert_reduce.linear_cross_entropy import linear_cross_entropy_weighted_sum
from tests.helpers.dist_utils import run_distributed
from tests.helpers.linear_reference import linear_reference, make_head_batch
from tests.helpers.megatron_cpu import megatron_on_cpu
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

CHUNKS = {"chunk_rows": 4, "chunk_vocab": 3}


def _tensor_parallel_body() -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    vocab, shard = 14, 7
    cols = slice(tp_rank * shard, (tp_rank + 1) * shard)
    hidden, weight, bias, labels, mask = make_head_batch(3, 10, 5, vocab, mask_prob=0.4, seed=3)
    coef = mask * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    ref_losses, ref_hidden, ref_weight, ref_bias = linear_reference(
        hidden, weight, bias, labels, coef
    )
    counts = mask.sum(dim=1)
    for capacity, num_scored in [("all", None), ("nonzero", None), (0.6, None), (1, counts)]:
        leaves = [hidden.clone(), weight[cols].clone(), bias[cols].clone()]
        leaves = [leaf.requires_grad_(True) for leaf in leaves]
        with count_collectives() as calls:
            losses = linear_cross_entropy_token_losses(
                leaves[0], leaves[1], labels, mask, bias=leaves[2],
                capacity=capacity, num_scored=num_scored, **CHUNKS,
            )  # fmt: skip
        assert dict(calls) == {"all_reduce": 1}, (capacity, dict(calls))
        (losses * coef).sum().backward()
        torch.testing.assert_close(losses, ref_losses, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(leaves[1].grad, ref_weight[cols], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(leaves[2].grad, ref_bias[cols], rtol=1e-10, atol=1e-12)
        # As with F.linear on a vocab shard, the hidden gradient is this shard's part; the sum
        # over TP ranks (Megatron's copy_to_tensor_model_parallel_region) is the whole one.
        hidden_grad = leaves[0].grad.clone()
        dist.all_reduce(hidden_grad, group=tp_group)
        torch.testing.assert_close(hidden_grad, ref_hidden, rtol=1e-10, atol=1e-12)

    # The weighted sum: gradients accumulated in the forward, after the one all-reduce
    # (two passes over the shard's chunks), scaled by the upstream gradient in backward.
    expected_sum = (ref_losses * coef).sum()
    for capacity, num_scored in [("all", None), (None, None), (0.6, None), (1, int(mask.sum()))]:
        leaves = [hidden.clone(), weight[cols].clone(), bias[cols].clone()]
        leaves = [leaf.requires_grad_(True) for leaf in leaves]
        rows = {} if capacity is None else {"capacity": capacity}
        with count_collectives() as calls:
            total = linear_cross_entropy_weighted_sum(
                leaves[0], leaves[1], labels, coef.double(), bias=leaves[2],
                num_scored=num_scored, **rows, **CHUNKS,
            )  # fmt: skip
            (0.5 * total).backward()
        assert dict(calls) == {"all_reduce": 1}, (capacity, dict(calls))
        torch.testing.assert_close(total, expected_sum, rtol=1e-10, atol=0)
        torch.testing.assert_close(leaves[1].grad, ref_weight[cols] / 2, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(leaves[2].grad, ref_bias[cols] / 2, rtol=1e-10, atol=1e-12)
        hidden_grad = leaves[0].grad.clone()
        dist.all_reduce(hidden_grad, group=tp_group)
        torch.testing.assert_close(hidden_grad, ref_hidden / 2, rtol=1e-10, atol=1e-12)

    # Through the loss reduction, with the collator's CPU count: one collective, no sync.
    leaves = [hidden.clone(), weight[cols].clone(), bias[cols].clone()]
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    loss_fn = BERTMLMLossWithReduction()
    loss_fn.setup({"labels": labels, "loss_mask": mask, "num_scored": counts})
    forward_out = {"hidden_states": leaves[0], "output_weight": leaves[1], "output_bias": leaves[2]}
    with forbid_host_syncs(), count_collectives() as calls:
        loss_sum, num_tokens, _ = loss_fn(forward_out)
        loss_sum.backward()
    assert dict(calls) == {"all_reduce": 1} and int(num_tokens) == int(mask.sum())
    _, _, ref_weight, _ = linear_reference(hidden, weight, bias, labels, mask.double())
    torch.testing.assert_close(leaves[1].grad, ref_weight[cols], rtol=1e-10, atol=1e-12)


def _sequence_parallel_body() -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    vocab, shard, seq_len = 14, 7, 10
    cols = slice(tp_rank * shard, (tp_rank + 1) * shard)
    rows = slice(tp_rank * seq_len // 2, (tp_rank + 1) * seq_len // 2)
    hidden, weight, bias, labels, mask = make_head_batch(3, seq_len, 5, vocab, seed=4)
    coef = mask.double()
    ref_losses, ref_hidden, ref_weight, ref_bias = linear_reference(
        hidden, weight, bias, labels, coef
    )
    leaves = [hidden[rows].clone(), weight[cols].clone(), bias[cols].clone()]
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    with megatron_on_cpu():
        losses = linear_cross_entropy_token_losses(
            leaves[0], leaves[1], labels, mask, bias=leaves[2], sequence_parallel=True, capacity=0.5
        )
        (losses * coef).sum().backward()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-10, atol=1e-12)
    # The sequence shard's gradient is whole: Megatron's reduce-scatter summed the shards'.
    torch.testing.assert_close(leaves[0].grad, ref_hidden[rows], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaves[1].grad, ref_weight[cols], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaves[2].grad, ref_bias[cols], rtol=1e-10, atol=1e-12)

    # The weighted sum on the sequence shard, with the count as an int.
    leaves = [hidden[rows].clone(), weight[cols].clone(), bias[cols].clone()]
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    with megatron_on_cpu():
        total = linear_cross_entropy_weighted_sum(
            leaves[0], leaves[1], labels, coef, bias=leaves[2], sequence_parallel=True,
            num_scored=int(mask.sum()),
        )  # fmt: skip
        total.backward()
    torch.testing.assert_close(total, (ref_losses * coef).sum(), rtol=1e-10, atol=0)
    torch.testing.assert_close(leaves[0].grad, ref_hidden[rows], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaves[1].grad, ref_weight[cols], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaves[2].grad, ref_bias[cols], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_full_vocab_reference() -> None:
    run_distributed(_tensor_parallel_body, 2, tp=2)


@pytest.mark.slow
def test_sequence_parallel_two_ranks_match_full_reference() -> None:
    run_distributed(_sequence_parallel_body, 2, tp=2)
