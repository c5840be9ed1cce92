"""ValidationPerplexityCallback against a one-pass reference, in one process, on
perplexity_helpers' uneven validation set. DDP: tests/integration/test_lightning_distributed.py.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from bert_reduce.lightning import ValidationPerplexityCallback
from tests.helpers.perplexity_helpers import (
    BATCH,
    SIZE,
    MLMSamples,
    TinyMLM,
    assert_matches_reference,
    reference,
)
from tests.helpers.sync_guard import forbid_host_syncs
from tests.helpers.tiny_lightning import quiet_trainer as trainer


def test_validate_equals_one_pass_reference_and_nemo_mean_of_means_does_not() -> None:
    data, model = MLMSamples(SIZE), TinyMLM()
    callback = ValidationPerplexityCallback()
    (logged,) = trainer([callback]).validate(model, DataLoader(data, BATCH), verbose=False)

    assert_matches_reference(callback, model, data)
    ref_loss, ref_ppl, _ = reference(model, data[:])
    assert logged["val_loss"] == pytest.approx(float(ref_loss), rel=1e-12)
    assert logged["val_ppl"] == pytest.approx(float(ref_ppl), rel=1e-12)

    # The batches hold different numbers of masked tokens, so NeMo 2's val_loss (the mean over
    # steps of each step's mean) is not the mean over the validation set's masked tokens.
    steps = [reference(model, data[i : i + BATCH]) for i in range(0, SIZE, BATCH)]
    counts = [count for _, _, count in steps]
    assert len(set(counts)) == len(counts), counts
    mean_of_means = float(torch.stack([loss for loss, _, _ in steps]).mean())
    assert logged["nemo_val_loss"] == pytest.approx(mean_of_means, rel=1e-12)
    assert abs(logged["nemo_val_loss"] - float(ref_loss)) > 1e-3


def test_batches_are_summed_without_host_sync_and_nothing_is_kept() -> None:
    data, model = MLMSamples(SIZE), TinyMLM()
    callback = ValidationPerplexityCallback()
    run = trainer([callback])
    run.validate(model, DataLoader(data, BATCH), verbose=False)
    reports = [model._loss(data[i : i + 3], validation=True)[1] for i in range(0, SIZE, 3)]
    callback.on_validation_epoch_start(run, model)
    with forbid_host_syncs():
        for index, report in enumerate(reports):
            callback.on_validation_batch_end(run, model, report, None, index)
    states = [value for value in vars(callback.metric).values() if isinstance(value, torch.Tensor)]
    assert {tuple(state.shape) for state in callback.metric.metric_state.values()} == {()}
    assert all(state.dim() == 0 for state in states)
    expected = torch.stack([r["loss_sum_and_microbatch_size"] for r in reports]).sum(0)
    assert float(callback.metric.loss_sum) == float(expected[0])
    assert int(callback.metric.denominator) == int(expected[1])


class _NoReport(TinyMLM):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)


class _WrongReport(TinyMLM):
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"loss": super().validation_step(batch, batch_idx)["loss_sum_and_microbatch_size"]}


def test_validation_step_contract_errors_name_what_is_missing() -> None:
    data = MLMSamples(SIZE)
    with pytest.raises(ValueError, match=r"_NoReport.validation_step returned None for batch 0"):
        trainer([ValidationPerplexityCallback()]).validate(_NoReport(), DataLoader(data, BATCH))
    expected = r"no 'loss_sum_and_microbatch_size' or 'loss_sum_and_ub_size' key; it has \['loss'\]"
    with pytest.raises(KeyError, match=expected):
        trainer([ValidationPerplexityCallback()]).validate(_WrongReport(), DataLoader(data, BATCH))


class _Interrupted(Exception):
    pass


class _StopMidValidation(TinyMLM):
    def __init__(self, path: str) -> None:
        super().__init__(lr=0.1)
        self.path = path

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        report = super().validation_step(batch, batch_idx)
        if not self.trainer.sanity_checking and self.current_epoch == 0 and batch_idx == 1:
            self.trainer.save_checkpoint(self.path)
            raise _Interrupted
        return report


class _Record(pl.Callback):
    """The callback's result after the sanity check, and after each validation epoch."""

    def __init__(self, callback: ValidationPerplexityCallback) -> None:
        self.callback = callback
        self.after_sanity_check: list[Any] = []
        self.epochs: list[tuple[int, float, int]] = []
        self.trainer: pl.Trainer | None = None

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after_sanity_check.append(self.callback.result)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        result = self.callback.result
        assert result is not None
        self.epochs.append(
            (trainer.current_epoch, float(result.perplexity), int(result.denominator))
        )


def test_fit_ignores_sanity_checks_and_a_resumed_run_reports_the_uninterrupted_values(
    tmp_path: Any,
) -> None:
    data = MLMSamples(SIZE)
    options = {"max_epochs": 2, "limit_train_batches": 2, "num_sanity_val_steps": 2}

    def run(model: TinyMLM, callback: ValidationPerplexityCallback, **fit: Any) -> _Record:
        record = _Record(callback)
        record.trainer = trainer([callback, record], **options)
        record.trainer.fit(model, DataLoader(data, BATCH), DataLoader(data, BATCH), **fit)
        return record

    model, first = TinyMLM(lr=0.1), ValidationPerplexityCallback()
    uninterrupted = run(model, first)
    # Every epoch counts the whole set once, the sanity check's batches never; the last result
    # is the trained model's one-pass reference, and what is logged.
    assert uninterrupted.after_sanity_check == [None]
    ref_count = reference(model, data[:])[2]
    assert [(epoch, n) for epoch, _, n in uninterrupted.epochs] == [(0, ref_count), (1, ref_count)]
    assert_matches_reference(first, model, data)
    logged = uninterrupted.trainer.callback_metrics["val_ppl"]
    assert float(logged) == pytest.approx(float(first.result.perplexity), rel=1e-12)

    path = os.path.join(tmp_path, "mid_validation.ckpt")
    callback = ValidationPerplexityCallback()
    with pytest.raises(_Interrupted):
        run(_StopMidValidation(path), callback)
    assert callback.metric.denominator > 0  # batches of the interrupted epoch were counted
    # The same callback object goes on: the restarted epoch must not add to what it held.
    resumed = run(TinyMLM(lr=0.1), callback, ckpt_path=path)
    assert resumed.epochs == uninterrupted.epochs

    # The last result travels in checkpoints: a run restored from the end reports it.
    end = os.path.join(tmp_path, "end.ckpt")
    resumed.trainer.save_checkpoint(end)
    restored = ValidationPerplexityCallback()
    run(TinyMLM(lr=0.1), restored, ckpt_path=end)  # max_epochs reached: restores, then stops
    assert restored.result is not None and callback.result is not None
    for saved, live in zip(restored.result, callback.result, strict=True):
        assert torch.equal(saved, live)
