from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from bert_reduce.lightning import ExactMLMModule, GlobalBatchSampler, split_micro_batches
from bert_reduce.num_scored import NumScoredCollator
from tests.helpers import exact_training as et
from tests.helpers.tiny_lightning import quiet_trainer


@pytest.mark.parametrize(
    ("micro_batch_size", "count_scored", "optimizer", "mode"),
    [
        (8, False, et.SGD, "per_token"),
        (4, True, et.SGD, "per_token"),  # each micro-batch's loss gets its own count, an int
        (2, False, et.SGD, "per_token"),
        (1, True, et.SGD, "per_token"),
        (2, False, et.ADAMW, "per_sequence"),
        (2, False, et.ADAMW, "constant"),
    ],
)
def test_single_device_training_equals_the_global_batch(
    micro_batch_size: int, count_scored: bool, optimizer, mode: str
) -> None:
    run = et.lightning_train(
        micro_batch_size=micro_batch_size, optimizer=optimizer, mode=mode, count_scored=count_scored
    )
    if count_scored:
        et.assert_each_loss_got_its_micro_batch_count()
        assert len(et.CountRecordingLoss.seen) == et.STEPS * et.GLOBAL_BATCH // micro_batch_size
    et.assert_trains_as_reference(run, optimizer, mode)


@pytest.mark.parametrize(
    ("precision", "loss_rtol", "param_atol"),
    [("32-true", 1e-6, 1e-6), ("bf16-mixed", 5e-3, 1e-2)],  # bf16 autocast: close, not exact
)
def test_lower_precisions_train_close_to_the_fp64_reference(
    precision: str, loss_rtol: float, param_atol: float
) -> None:
    run = et.lightning_train(micro_batch_size=2, precision=precision)
    expected, expected_losses = et.reference_train(et.SGD, clip=None)
    torch.testing.assert_close(run.losses, expected_losses, rtol=loss_rtol, atol=0)
    for name, value in expected.items():
        torch.testing.assert_close(run.params[name].double(), value, rtol=0, atol=param_atol)


def test_per_sample_counts_survive_the_batch_transfer_and_split_into_ints() -> None:
    """Lightning moves the tensors (to "meta", standing in for an accelerator), not the counts."""
    dataset = et.MLMSamples()
    batch = NumScoredCollator(default_collate, per_sample=True)([dataset[i] for i in range(8)])
    module = ExactMLMModule(et.initial_model(), micro_batch_size=2)
    moved = module.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved["loss_mask"].device.type == "meta"
    parts = module.micro_batches(moved)
    assert [part["num_scored"] for part in parts] == [4, 0, 7, 7]
    assert list(et.MASK_COUNTS[:8]) == [3, 1, 0, 0, 5, 2, 6, 1]
    one = split_micro_batches({**moved, "num_scored": 17}, 8)
    assert one[0]["num_scored"] == 17  # a whole batch's int, for one micro-batch


def test_split_micro_batches_keeps_order_and_shares_non_tensors() -> None:
    batch = {"input_ids": torch.arange(12).view(6, 2), "mask": torch.ones(6, 2), "tag": "x"}
    parts = split_micro_batches(batch, 2)
    assert len(parts) == 3
    assert [part["tag"] for part in parts] == ["x"] * 3
    torch.testing.assert_close(torch.cat([part["input_ids"] for part in parts]), batch["input_ids"])


@pytest.mark.parametrize(
    ("batch", "size", "message"),
    [
        ({"a": torch.zeros(6, 2)}, 4, r"holds 6 samples, not a multiple of micro_batch_size=4"),
        ({"a": torch.zeros(6), "b": torch.zeros(5)}, 2, r"disagree on the batch dim.*'b': 5"),
        ({"a": torch.zeros(())}, 1, r"0-dim tensors batch\['a'\]"),
        ({"a": 1}, 1, r"no tensor to split; its keys are \['a'\]"),
        ({"a": torch.zeros(2)}, 0, r"micro_batch_size must be >= 1, got 0"),
        ({"a": torch.zeros(4), "num_scored": (1, 2, 3)}, 2, r"holds 3 per-sample counts"),
    ],
)
def test_split_micro_batches_errors(batch: dict, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_micro_batches(batch, size)


def test_module_needs_an_optimizer() -> None:
    module = ExactMLMModule(et.initial_model(), micro_batch_size=1)
    with pytest.raises(ValueError, match=r"needs an optimizer"):
        module.configure_optimizers()


def _fit(module: ExactMLMModule, max_steps: int, **sampler_options) -> pl.Trainer:
    dataset = et.MLMSamples()
    sampler = GlobalBatchSampler(len(dataset), 8, 1, **sampler_options)
    trainer = quiet_trainer(max_steps=max_steps, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=DataLoader(dataset, batch_sampler=sampler))
    return trainer


def test_scheduler_is_stepped_once_per_optimizer_step() -> None:
    module = ExactMLMModule(
        et.initial_model(),
        micro_batch_size=1,
        optimizer=et.SGD,
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
    )
    assert _fit(module, max_steps=3).global_step == 3
    assert module.optimizers().param_groups[0]["lr"] == 0.5 * 0.5**3


def test_a_sampler_built_for_another_rank_is_refused() -> None:
    module = ExactMLMModule(et.initial_model(), micro_batch_size=1, optimizer=et.SGD)
    with pytest.raises(ValueError, match=r"is rank 1 of 2, but this process is rank 0 of 1"):
        _fit(module, max_steps=1, num_replicas=2, rank=1)
