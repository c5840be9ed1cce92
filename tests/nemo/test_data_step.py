"""num_scored_data_step: NeMo's and BioNeMo-style data steps hand the loss this rank's count.

NeMo's ``bert_data_step`` keeps only the keys it knows and, under context parallelism, slices
every value along the sequence; the wrapper adds this CP shard's host count back as an ``int``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from nemo.collections.llm.bert.model.base import bert_data_step
from nemo.lightning.megatron_parallel import default_data_step
from torch.utils.data import default_collate

from bert_reduce.context_parallel import context_parallel_indices
from bert_reduce.nemo import num_scored_data_step
from bert_reduce.num_scored import NumScoredCollator
from tests.helpers.dist_utils import run_distributed
from tests.helpers.megatron_bert import mlm_batch
from tests.helpers.megatron_cpu import megatron_on_cpu, single_process_megatron


def nemo_bert_batch(seed: int = 0) -> dict:
    """NumScoredCollator's batch of the keys NeMo's bert_data_step reads (``padding_mask`` ...)."""
    batch = mlm_batch(3, seed, seq_len=8, empty_rows=())
    batch["padding_mask"] = batch.pop("attention_mask")
    batch["types"] = batch["is_random"] = torch.zeros(3, 8, dtype=torch.long)
    samples = [{k: v[i] for k, v in batch.items()} for i in range(3)]
    return NumScoredCollator(default_collate)(samples)


def test_nemo_bert_data_step_drops_the_count_and_the_wrapper_keeps_it() -> None:
    batch = nemo_bert_batch()
    total = int(batch["loss_mask"].sum())
    with single_process_megatron(), megatron_on_cpu():
        # NeMo's own step: every key it does not know becomes None.
        assert bert_data_step(iter([dict(batch)]))["num_scored"] is None
        uncounted = {k: v for k, v in batch.items() if k != "num_scored"}
        for step in (bert_data_step, default_data_step):
            for item in (batch, (batch, 0, 0), uncounted):
                out = num_scored_data_step(step)(iter([item]))
                assert type(out["num_scored"]) is int and out["num_scored"] == total
                assert torch.equal(out["loss_mask"], batch["loss_mask"])


def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(TypeError, match="batches that are dicts, got list"):
        num_scored_data_step(default_data_step)(iter([[torch.zeros(2)]]))
    with pytest.raises(TypeError, match="returned Tensor, not a dict"):
        num_scored_data_step(lambda it: next(it)["loss_mask"])(iter([nemo_bert_batch()]))


def _context_parallel_body() -> None:
    batch = nemo_bert_batch(seed=1)
    total, cp_rank = batch["num_scored"], parallel_state.get_context_parallel_rank()
    with megatron_on_cpu():
        out = num_scored_data_step(bert_data_step)(iter([batch]))
    # Megatron's slicer made the shard on the device side; the count is that shard's.
    index = context_parallel_indices(8, 2, cp_rank)
    assert torch.equal(out["loss_mask"], batch["loss_mask"][:, index])
    assert type(out["num_scored"]) is int and out["num_scored"] == int(out["loss_mask"].sum())
    counts = torch.zeros(2, dtype=torch.long)
    counts[cp_rank] = out["num_scored"]
    dist.all_reduce(counts)
    assert int(counts.sum()) == total and counts.min() > 0, counts


@pytest.mark.slow
def test_context_parallel_ranks_each_get_their_shards_count() -> None:
    run_distributed(_context_parallel_body, 2, cp=2)
