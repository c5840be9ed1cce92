"""cross_entropy_loss_sum on vocab-sharded logits, on 2 gloo processes.

Each rank holds half of the vocabulary; the loss sum and each rank's slice of its gradient
equal ``F.cross_entropy`` on the full-vocabulary logits, with one all-reduce, through
Megatron's tensor-parallel group or a group passed in without Megatron.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce.cross_entropy import cross_entropy_loss_sum
from tests.helpers.dist_utils import run_distributed
from tests.helpers.reference import make_mlm_batch, reference_loss_and_grad
from tests.helpers.sync_guard import count_collectives

pytestmark = pytest.mark.slow


def _tensor_parallel_body(megatron: bool) -> None:
    # Megatron's tensor-parallel group, or (no Megatron) the group passed in.
    tp_group = None if megatron else dist.group.WORLD
    tp_rank = dist.get_rank()
    vocab, shard = 14, 7
    cols = slice(tp_rank * shard, (tp_rank + 1) * shard)
    logits, labels, mask = make_mlm_batch(3, 10, vocab, mask_prob=0.4, seed=3)
    weights = mask * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grad = reference_loss_and_grad(logits, labels, weights, "sum")
    for capacity in ["all", "nonzero", 0.6]:
        for in_place in (False, True):
            leaf = logits[..., cols].clone().requires_grad_(True)
            with count_collectives() as calls:
                loss_sum, _ = cross_entropy_loss_sum(
                    leaf * 1,
                    labels,
                    weights,
                    capacity=capacity,
                    in_place=in_place,
                    chunk_elements=20,
                    tp_group=tp_group,
                )
            assert dict(calls) == {"all_reduce": 1}, (capacity, dict(calls))
            loss_sum.backward()
            torch.testing.assert_close(loss_sum, ref_loss, rtol=1e-13, atol=0)
            torch.testing.assert_close(leaf.grad, ref_grad[..., cols], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("megatron", [True, False], ids=["megatron", "explicit_group"])
def test_tensor_parallel_two_ranks_match_full_vocab_reference(megatron) -> None:
    run_distributed(_tensor_parallel_body, 2, megatron, tp=2 if megatron else 1, megatron=megatron)
