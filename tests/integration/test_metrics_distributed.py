"""TokenPerplexity on 2 gloo processes: tensor parallel, then data parallel.

Against ``exp(F.cross_entropy)`` over every masked token of the whole, unsplit batch: with
vocab-sharded logits (TP = 2) the metric adds no collective of its own and must not be summed
over the TP ranks; with rows split unevenly over DP = 2, its sync gives the global value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce import TokenPerplexity, cross_entropy_loss_sum
from tests.helpers.dist_utils import run_distributed
from tests.helpers.reference import (
    UNEVEN_MICRO_BATCHES,
    UNEVEN_VOCAB,
    reference_loss,
    uneven_mlm_batch,
)
from tests.helpers.sync_guard import count_collectives

pytestmark = pytest.mark.slow


def _distributed_body(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    from megatron.core import parallel_state as ps

    logits, labels, mask = batch
    expected = reference_loss(logits, labels, mask).exp()
    total = int(mask.sum())
    rank = dist.get_rank()

    def synced_count(metric: TokenPerplexity) -> int:
        with metric.sync_context():
            return int(metric.denominator)

    # TP = 2: each rank holds half of the vocabulary for every row.
    shard = UNEVEN_VOCAB // 2
    local = logits[..., rank * shard : (rank + 1) * shard]
    metric, summed_over_world = TokenPerplexity(), TokenPerplexity(process_group=dist.group.WORLD)
    with count_collectives() as calls:
        for rows in UNEVEN_MICRO_BATCHES:
            metric.update_from_logits(local[:, rows], labels[rows], mask[rows])
            summed_over_world.update_from_logits(local[:, rows], labels[rows], mask[rows])
    # Megatron's vocab-parallel CE reduces over TP inside; the metric itself adds nothing.
    assert set(calls) <= {"all_reduce"}
    torch.testing.assert_close(metric.compute(), expected, rtol=2e-6, atol=0)
    assert synced_count(metric) == total
    # Tensor-parallel ranks hold the same sums: reducing over them would count tokens twice.
    assert synced_count(summed_over_world) == 2 * total

    # DP = 2: rows split unevenly (5 vs 2 rows, 3 vs 1 micro-batches), full vocabulary.
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    mine = UNEVEN_MICRO_BATCHES[:3] if rank == 0 else UNEVEN_MICRO_BATCHES[3:]
    sums = [cross_entropy_loss_sum(logits[:, rows], labels[rows], mask[rows]) for rows in mine]
    metric = TokenPerplexity()
    with count_collectives() as calls:
        for loss_sum, num_tokens in sums:
            metric.update(loss_sum, num_tokens)
    assert not calls
    torch.testing.assert_close(metric.compute(), expected, rtol=2e-6, atol=0)
    assert synced_count(metric) == total


def test_tensor_and_data_parallel_equal_one_pass_reference() -> None:
    run_distributed(_distributed_body, 2, uneven_mlm_batch(), tp=2)
