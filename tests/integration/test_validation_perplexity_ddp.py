"""ValidationPerplexityCallback under Lightning DDP on 2 gloo processes.

With every validation sample on exactly one rank (Lightning's UnrepeatedDistributedSampler or
bert_reduce's ShardedEvalBatchSampler), the result equals the one-pass reference, with no
collective while batches run and one sync at the end; Lightning's default DistributedSampler
repeats a sample, which the callback refuses (and which, unchecked, counts tokens twice).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader

from bert_reduce.lightning import ShardedEvalBatchSampler, ValidationPerplexityCallback
from tests.helpers.dist_utils import join_existing_group, run_distributed
from tests.helpers.perplexity_helpers import (
    BATCH,
    SIZE,
    MLMSamples,
    TinyMLM,
    assert_matches_reference,
    loader,
    reference,
)
from tests.helpers.sync_guard import count_collectives
from tests.helpers.tiny_lightning import quiet_trainer as trainer

pytestmark = pytest.mark.slow


def _ddp_body(world_size: int) -> None:
    """Every check that needs real DDP processes, in one spawn."""
    rank = dist.get_rank()
    join_existing_group()
    ddp = {"devices": world_size, "strategy": "ddp"}
    data, model = MLMSamples(SIZE), TinyMLM()
    _, _, ref_count = reference(model, data)

    # The fix: every sample on exactly one rank, with Lightning's UnrepeatedDistributedSampler
    # (Lightning keeps a DistributedSampler it is given) or bert_reduce's
    # ShardedEvalBatchSampler. Count the collectives: none while batches run, one sync at the end.
    for size, sharded in ((SIZE, False), (9, False), (SIZE, True)):  # 9: 2 batches vs 1
        subset = MLMSamples(size)
        if sharded:
            batches = ShardedEvalBatchSampler(size, BATCH, num_replicas=world_size, rank=rank)
            val_loader = DataLoader(subset, batch_sampler=batches)
        else:
            sampler = UnrepeatedDistributedSampler(subset, world_size, rank, shuffle=False)
            val_loader = loader(subset, BATCH, sampler=sampler)
        callback = ValidationPerplexityCallback()
        counter = _CountCollectives()
        trainer([callback, counter], use_distributed_sampler=not sharded, **ddp).validate(
            model, val_loader, verbose=False
        )
        assert_matches_reference(callback, model, subset)
        assert counter.during_batches == Counter(), counter.during_batches
        # torchmetrics gathers each of the two scalar states once.
        at_epoch_end = counter.counts - counter.during_batches
        assert at_epoch_end["all_gather"] == 2, at_epoch_end

    # Lightning's default DistributedSampler pads the 11 samples to 12 by repeating sample 0:
    # the check refuses it, and without the check its tokens count twice.
    with pytest.raises(ValueError, match=r"repeats 1 of the 11 samples"):
        trainer([ValidationPerplexityCallback()], **ddp).validate(model, loader(data, BATCH))
    stock = ValidationPerplexityCallback(check_sampler=False)
    trainer([stock], **ddp).validate(model, loader(data, BATCH), verbose=False)
    assert stock.result is not None
    repeated = int(data.loss_mask[0].sum())
    assert repeated > 0 and int(stock.result.denominator) == ref_count + repeated
    assert not torch.allclose(stock.result.perplexity, reference(model, data)[1], rtol=1e-6)


class _CountCollectives(pl.Callback):
    """Counts torch.distributed collectives from the start of the validation epoch:
    ``during_batches`` until the last batch ends, ``counts`` until the validation ends."""

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule):
        self._context = count_collectives()
        self.counts, self.during_batches = self._context.__enter__(), Counter()

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.during_batches = Counter(self.counts)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._context.__exit__(None, None, None)


def test_ddp_gloo_equals_one_pass_reference() -> None:
    run_distributed(_ddp_body, 2, 2, megatron=False)
