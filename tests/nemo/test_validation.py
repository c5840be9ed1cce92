"""Exact validation loss and perplexity inside a real NeMo 2 fit (DP=2, uneven shards).

13 validation samples (one without a masked token), a global batch of 8 over 2 ranks:
``ExactValidationDataSampler`` pads the set to 16 with unscored samples, so rank 0 holds 7
real samples and rank 1 holds 6, and nothing is dropped. ``NeMoValidationPerplexityCallback``
collects NeMo's per-micro-batch reports; after one training step its ``val_loss`` and
``val_ppl`` equal ``F.cross_entropy`` over every masked token of the validation set in one
pass, with the reference's weights after one step. NeMo's own ``val_loss`` (a mean of the
validation steps' means) is recorded for comparison.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import lightning.pytorch as pl
import torch
from typing_extensions import override

from bert_reduce.nemo import NeMoValidationPerplexityCallback, PaddedEvalDataset
from tests.helpers.megatron_cpu import single_process_megatron
from tests.nemo.cpu_stand_ins import megatron_on_cpu
from tests.nemo.fit_helpers import nemo_trainer, optimizer_module
from tests.nemo.tiny_bert import (
    TinyBertDataModule,
    TinyBertMLM,
    reference_val_loss,
    run_processes,
    scratch_dir,
    tiny_bert_config,
    val_dataset,
)

VAL_SAMPLES = 13


class _NeMoMeanRecorder(pl.Callback):
    """NeMo's own ``val_loss`` (logged from ``validation_step``): one value per step."""

    def __init__(self) -> None:
        self.step_means: list[float] = []

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self.step_means.append(float(outputs))


def _validate_body(out_dir: str) -> None:
    callback = NeMoValidationPerplexityCallback()
    nemo_means = _NeMoMeanRecorder()
    trainer = nemo_trainer(
        2, steps=1, callbacks=[callback, nemo_means], limit_val_batches=None, val_check_interval=1
    )
    model = TinyBertMLM(tiny_bert_config())
    optimizer_module().connect(model)
    dm = TinyBertDataModule(1, val_samples=VAL_SAMPLES, exact_validation=True)
    with megatron_on_cpu():
        trainer.fit(model, dm)
    assert callback.result is not None
    torch.save(
        {
            "result": callback.result._asdict(),
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "nemo_step_means": nemo_means.step_means,
        },
        Path(out_dir) / f"rank{trainer.global_rank}.pt",
    )


def test_padded_eval_dataset_adds_only_unscored_samples() -> None:
    data = val_dataset(VAL_SAMPLES)
    padded = PaddedEvalDataset(data, 8)
    assert len(padded) == 16
    assert all(torch.equal(padded[i]["text"], data[i]["text"]) for i in range(VAL_SAMPLES))
    assert all(not padded[i]["loss_mask"].any() for i in range(VAL_SAMPLES, 16))
    with pytest.raises(ValueError, match="non-empty dataset"):
        PaddedEvalDataset(val_dataset(0), 8)


@pytest.mark.slow
def test_nemo_validation_perplexity_is_exact_over_uneven_shards() -> None:
    with single_process_megatron(), megatron_on_cpu():
        ref = reference_val_loss(1, VAL_SAMPLES)
    with scratch_dir() as out_dir:
        run_processes(_validate_body, 2, out_dir)
        results = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(2)]
    mask = val_dataset(VAL_SAMPLES).loss_mask
    for result in results:
        assert result["result"]["denominator"].item() == mask.sum().item()
        torch.testing.assert_close(result["result"]["loss"].item(), ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(result["logged"]["val_loss"], ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(result["logged"]["val_ppl"], math.exp(ref), rtol=1e-6, atol=0)
    print(
        f"exact val_loss {ref:.7f}; NeMo's mean of step means "
        f"{sum(results[0]['nemo_step_means']) / len(results[0]['nemo_step_means']):.7f}"
    )
