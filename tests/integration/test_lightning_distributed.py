"""Lightning on 2 gloo processes: ExactMLMModule under DDP and ModelParallelStrategy (FSDP2), and
ValidationPerplexityCallback under DDP, against one process on the whole global batch or
validation set (tests/helpers/exact_training.py, perplexity_helpers.py; one process:
tests/lightning/). Each check's comments say what it covers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from bert_reduce.lightning import ShardedEvalBatchSampler, ValidationPerplexityCallback
from tests.helpers import exact_training as et
from tests.helpers.dist_utils import join_existing_group, run_distributed
from tests.helpers.perplexity_helpers import (
    BATCH,
    SIZE,
    MLMSamples,
    TinyMLM,
    assert_matches_reference,
    reference,
)
from tests.helpers.sync_guard import count_collectives
from tests.helpers.tiny_lightning import quiet_trainer as trainer

pytestmark = pytest.mark.slow

VAL_SIZE = 7  # split 3 + 4 over two ranks, in batches of 2: ranks run 2 and 2 uneven batches


def _train(strategy: str, micro_batch_size: int, **kwargs) -> et.Run:
    if strategy == "fsdp2":
        # ModelParallelStrategy refuses "64-true"; "32-true" leaves the fp64 model as is.
        kwargs.update(precision="32-true", model_dtype=torch.float64)
    return et.lightning_train(
        micro_batch_size=micro_batch_size,
        strategy=et.existing_group(strategy),
        devices=torch.distributed.get_world_size(),
        **kwargs,
    )


def _ddp_checks() -> None:
    # One micro-batch per rank here; 2 and 1 samples per micro-batch in the runs below.
    et.assert_trains_as_reference(_train("ddp", et.GLOBAL_BATCH // 2))
    et.assert_trains_as_reference(_train("ddp", 2, optimizer=et.ADAMW), et.ADAMW)

    # Clipping of the exact global gradient; counted collectives and no host sync in the step
    # (SGD: Adam's own step reads its step count on the host); an uneven validation set whose
    # reports sum to the loss of the whole set; the count of each micro-batch.
    expected, _ = et.reference_train(et.SGD, clip=None)
    expected_clipped, _ = et.reference_train(et.SGD, clip=0.05)
    et.GRADIENT_BUCKETS_REDUCED.clear()
    et.InstrumentedModule.collectives_per_step = []
    run = _train(
        "ddp", 1, clip=0.05, module_cls=et.InstrumentedModule, val_size=VAL_SIZE, count_scored=True
    )
    et.assert_each_loss_got_its_micro_batch_count()
    et.assert_params_close(run.params, expected_clipped)
    assert et.max_param_difference(expected_clipped, expected) > 1e-3  # the clip is active
    num_buckets = len(et.GRADIENT_BUCKETS_REDUCED) // et.STEPS
    # One DDP gradient reduction per step (each bucket once) although each rank ran
    # 8 / world_size micro-batches, ...
    assert num_buckets >= 1
    assert et.GRADIENT_BUCKETS_REDUCED == list(range(num_buckets)) * et.STEPS
    # ... and one all-reduce of the sums; the hook's all-reduces of
    # the gradient buckets go through torch.distributed.all_reduce too.
    per_step = et.InstrumentedModule.collectives_per_step
    assert per_step == [{"all_reduce": num_buckets + 1}] * et.STEPS, per_step
    val_totals = run.val_totals.clone()
    torch.distributed.all_reduce(val_totals)
    clipped = TinyMLM()
    clipped.model.load_state_dict(expected_clipped)
    ref_loss, _, ref_count = reference(clipped, MLMSamples(seed=et.VAL_SEED)[:VAL_SIZE])
    assert int(val_totals[1]) == ref_count
    torch.testing.assert_close(val_totals[0], ref_loss * ref_count, rtol=1e-10, atol=0)

    et.assert_trains_as_reference(_train("ddp", 1, mode="per_sequence"), mode="per_sequence")
    # Lightning's own accumulation + DDP averaging: a mean of means, visibly different.
    assert et.max_param_difference(_train("ddp", 2, stock=True).params, expected) > 1e-3


def _fsdp2_checks() -> None:
    for mode, micro_batch_size in (("per_token", 1), ("per_token", 2), ("per_sequence", 2)):
        count_scored = micro_batch_size == 1
        run = _train("fsdp2", micro_batch_size, mode=mode, count_scored=count_scored)
        if count_scored:
            et.assert_each_loss_got_its_micro_batch_count()
        assert any(isinstance(p, DTensor) for p in run.module.parameters())
        et.assert_trains_as_reference(run, mode=mode)


def _validation_perplexity_checks() -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    join_existing_group()
    ddp = {"devices": world_size, "strategy": "ddp"}
    data, model = MLMSamples(SIZE), TinyMLM()
    _, ref_ppl, ref_count = reference(model, data[:])

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
            val_loader = DataLoader(subset, BATCH, sampler=sampler)
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
        trainer([ValidationPerplexityCallback()], **ddp).validate(model, DataLoader(data, BATCH))
    stock = ValidationPerplexityCallback(check_sampler=False)
    trainer([stock], **ddp).validate(model, DataLoader(data, BATCH), verbose=False)
    assert stock.result is not None
    repeated = int(data.loss_mask[0].sum())
    assert repeated > 0 and int(stock.result.denominator) == ref_count + repeated
    assert not torch.allclose(stock.result.perplexity, ref_ppl, rtol=1e-6)


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


def _body() -> None:
    _ddp_checks()
    _fsdp2_checks()
    _validation_perplexity_checks()


def test_exact_module_and_validation_callback_equal_one_process() -> None:
    run_distributed(_body, 2, megatron=False)
