"""Exact validation loss and perplexity in real NeMo 2 fits: any loader, any stage, never partial.

13 validation samples (one without a masked token), a global batch of 8, micro-batches of 2.
``ExactValidationDataSampler`` pads the set to 16 with unscored samples, so nothing is dropped:
at DP=2 rank 0 holds 7 real samples and rank 1 holds 6. ``NeMoValidationPerplexityCallback``
collects NeMo's per-micro-batch reports on the last pipeline stage; after one training step
the ``val_loss`` and ``val_ppl`` that reach the logger of every rank equal ``F.cross_entropy``
over every masked token of the validation set in one pass, with the reference's weights:

* at DP=2, with NeMo's ``WrappedDataLoader(mode="validation")`` and with a plain
  ``DataLoader`` (which NeMo's own sampler takes for a training loader and cuts to 8 samples);
* at DP=2 x PP=2 (4 processes; the first stage holds no reports and logs the last stage's).

With NeMo's own ``MegatronDataSampler``, which drops the last partial global batch (5 of the
13 samples), the callback stops the fit before any validation value reaches the logger. One
fit per set of processes: NeMo's groups do not survive a second fit in the same process.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import lightning.pytorch as pl
import torch
from megatron.core import parallel_state
from nemo import lightning as nl
from nemo.lightning.data import WrappedDataLoader
from torch.utils.data import DataLoader
from typing_extensions import override

from bert_reduce.nemo import (
    ExactValidationDataSampler,
    NeMoValidationPerplexityCallback,
    PaddedEvalDataset,
    RealSampleTracker,
)
from tests.helpers.dist_utils import load_rank_results, run_launched
from tests.helpers.megatron_cpu import megatron_on_cpu
from tests.helpers.nemo_bert import (
    MICRO_BATCH,
    TinyBertDataModule,
    TinyBertMLM,
    nemo_trainer,
    optimizer_module,
    reference_val_loss,
    tiny_bert_config,
    val_dataset,
)
from tests.helpers.tiny_lightning import RecordingLogger

VAL_SAMPLES = 13


class _PlainLoaderDataModule(TinyBertDataModule):
    """What any Lightning data module does: a plain ``DataLoader``, without NeMo's ``mode``."""

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(val_dataset(self.val_samples), batch_size=MICRO_BATCH)


# The data module of each variant: its validation loader and its data sampler.
_DATA_MODULES = {
    "wrapped": lambda: TinyBertDataModule(1, val_samples=VAL_SAMPLES, exact_validation=True),
    "plain": lambda: _PlainLoaderDataModule(1, val_samples=VAL_SAMPLES, exact_validation=True),
    "nemo_sampler": lambda: TinyBertDataModule(1, val_samples=VAL_SAMPLES),
}


class _NeMoMeanRecorder(pl.Callback):
    """NeMo's own ``val_loss`` (logged from ``validation_step``): one value per validation step."""

    def __init__(self) -> None:
        self.step_means: list[float] = []

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        if not trainer.sanity_checking:
            self.step_means.append(float(outputs))


def _validate_body(out_dir: str, world_size: int, pp: int, variant: str) -> None:
    callback = NeMoValidationPerplexityCallback()
    nemo_means = _NeMoMeanRecorder()
    logger = RecordingLogger()
    trainer = nemo_trainer(
        world_size,
        steps=1,
        pp=pp,
        callbacks=[callback, nemo_means],
        logger=logger,
        limit_val_batches=None,
        val_check_interval=1,
        num_sanity_val_steps=2,  # Lightning's default: not counted, must not disturb the count
    )
    model = TinyBertMLM(tiny_bert_config(pipeline_model_parallel_size=pp))
    optimizer_module().connect(model)
    result: dict[str, Any] = {}
    try:
        with megatron_on_cpu():
            trainer.fit(model, _DATA_MODULES[variant]())
    except RuntimeError as error:
        result["error"] = str(error)
    else:
        assert callback.result is not None
        tracker = trainer.val_dataloaders.batch_sampler
        result.update(
            result=callback.result._asdict(),
            real_on_rank=sum(tracker.is_real) if isinstance(tracker, RealSampleTracker) else None,
            nemo_step_means=nemo_means.step_means,
        )
    result["logged"] = logger.values
    result["callback_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    torch.save(result, Path(out_dir) / f"rank{trainer.global_rank}.pt")


def _run(world_size: int, pp: int, variant: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out_dir:
        run_launched(_validate_body, world_size, out_dir, world_size, pp, variant)
        return load_rank_results(out_dir, world_size)


@pytest.fixture(scope="module")
def reference() -> float:
    """Mean NLL over every masked validation token, one pass, after one reference step."""
    return reference_val_loss(1, VAL_SAMPLES)


def _assert_exact(results: list[dict[str, Any]], reference: float) -> None:
    mask = val_dataset(VAL_SAMPLES).loss_mask
    for run in results:
        assert "error" not in run, run.get("error")
        assert run["result"]["denominator"].item() == mask.sum().item()
        torch.testing.assert_close(run["result"]["loss"].item(), reference, rtol=1e-6, atol=0)
        # One validation epoch: one value of each reached the logger, and callback_metrics.
        logged = run["logged"]
        assert len(logged["val_loss"]) == len(logged["val_ppl"]) == 1
        val_loss, val_ppl = logged["val_loss"][0], logged["val_ppl"][0]
        torch.testing.assert_close(val_loss, reference, rtol=1e-6, atol=0)
        torch.testing.assert_close(val_ppl, math.exp(val_loss), rtol=1e-6, atol=0)
        assert run["callback_metrics"]["val_loss"] == val_loss
    # Every rank, every pipeline stage, logged the same values.
    logged = {(run["logged"]["val_loss"][0], run["logged"]["val_ppl"][0]) for run in results}
    assert len(logged) == 1


def test_padded_eval_dataset_adds_only_unscored_samples() -> None:
    data = val_dataset(VAL_SAMPLES)
    padded = PaddedEvalDataset(data, 8)
    assert len(padded) == 16
    assert all(torch.equal(padded[i]["text"], data[i]["text"]) for i in range(VAL_SAMPLES))
    assert all(not padded[i]["loss_mask"].any() for i in range(VAL_SAMPLES, 16))
    with pytest.raises(ValueError, match="non-empty dataset"):
        PaddedEvalDataset(val_dataset(0), 8)


def test_real_sample_tracker_records_each_pass() -> None:
    tracker = RealSampleTracker([[0, 1], [12, 13], [14, 15]], num_real=13)
    assert len(tracker) == 3
    assert list(tracker) == [[0, 1], [12, 13], [14, 15]]
    assert tracker.real_samples_in_first(4) == 3 and tracker.real_samples_in_first(6) == 3
    iterator = iter(tracker)  # a new pass starts a new record
    assert tracker.is_real == []
    next(iterator)
    assert tracker.real_samples_in_first(2) == 2
    with pytest.raises(ValueError, match="dealt only 2"):
        tracker.real_samples_in_first(4)


def test_sampler_copies_settings_and_reads_mode_without_trainer() -> None:
    nemo_sampler = nl.MegatronDataSampler(
        seq_len=12, micro_batch_size=2, global_batch_size=8, init_consumed_samples=16
    )
    sampler = ExactValidationDataSampler.from_sampler(nemo_sampler)
    assert vars(sampler) == vars(nemo_sampler)
    # No trainer (NeMo's Fabric strategy): NeMo's `mode` attribute, else a training loader.
    assert sampler.loader_mode(WrappedDataLoader(mode="validation", dataset=[0])) == "validation"
    assert sampler.loader_mode(DataLoader([0])) == "train"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["wrapped", "plain"])
def test_data_parallel_validation_is_exact_with_any_loader(variant, reference) -> None:
    results = _run(2, 1, variant)
    _assert_exact(results, reference)
    # Megatron's sampler dealt 8 samples to each rank: 7 and 6 of them real.
    assert [run["real_on_rank"] for run in results] == [7, 6]
    # NeMo's own val_loss, a mean of the steps' means, is another value (3.8223270).
    means = results[0]["nemo_step_means"]
    assert abs(sum(means) / len(means) - reference) > 1e-2


@pytest.mark.slow
def test_a_dropped_sample_stops_the_fit_before_anything_is_logged() -> None:
    """NeMo's own MegatronDataSampler drops the last partial global batch: 5 of 13 samples."""
    results = _run(2, 1, "nemo_sampler")
    for run in results:
        assert "cover 8 real samples" in run["error"] and "has 13" in run["error"]
        assert "ExactValidationDataSampler" in run["error"]
        assert "val_loss" not in run["logged"] and "val_ppl" not in run["logged"]


@pytest.mark.slow
def test_pipeline_parallel_validation_is_exact_on_every_stage(reference) -> None:
    """DP=2 x PP=2: the last stage's two ranks hold 7 and 6 real samples' reports."""
    results = _run(4, 2, "plain")
    assert sorted(run["pp_rank"] for run in results) == [0, 0, 1, 1]
    _assert_exact(results, reference)
    assert sorted(run["real_on_rank"] for run in results) == [6, 6, 7, 7]
