"""``python train.py model=hf_esm2``: Hugging Face's EsmForMaskedLM through the exact loss.

As for the default model (test_train_e2e.py): the same global batches give the same
per-step ``train_loss`` and final ``val_loss``/``val_ppl`` whatever the micro-batch size and
number of DDP processes. Runs offline (``HF_HUB_OFFLINE=1``), also from a local checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.recipe_runs import train, train_losses, validations, warnings_printed

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

HF_TINY = [
    "model=hf_esm2",
    "model.hidden_size=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.ffn_size=32",
    "trainer.max_steps=2",
]
SPLITS = [(16, 1), (4, 1), (8, 2)]  # (micro_batch_size, devices)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_same_losses_for_every_split(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    single = ",".join(str(micro) for micro, devices in SPLITS if devices == 1)
    train(sweep, *HF_TINY, f"data.micro_batch_size={single}", multirun=True)
    runs = {(micro, 1): sweep / str(job) for job, (micro, _) in enumerate(SPLITS[:2])}
    runs[8, 2] = tmp_path / "ddp"
    train(runs[8, 2], *HF_TINY, "data.micro_batch_size=8", "trainer.devices=2")

    ref_losses, ref_val = train_losses(runs[16, 1]), validations(runs[16, 1])
    assert sorted(ref_losses) == [1, 2] and sorted(ref_val) == [2]
    assert ref_losses[1] != ref_losses[2]
    for split, run_dir in runs.items():
        losses = train_losses(run_dir)
        for step, loss in ref_losses.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5), (split, step)
        (val_loss, val_ppl), (ref_loss, ref_ppl) = validations(run_dir)[2], ref_val[2]
        assert val_ppl == pytest.approx(ref_ppl, rel=1e-5), split
        assert val_loss == pytest.approx(ref_loss, rel=1e-5), split


def test_trains_from_a_local_checkpoint(tmp_path: Path) -> None:
    from bert_reduce.recipe.config import HFEsm2ModelConfig
    from bert_reduce.recipe.hf_esm import HFEsm2Model

    torch.manual_seed(0)
    checkpoint = tmp_path / "checkpoint"
    shape = HFEsm2ModelConfig(hidden_size=8, num_layers=1, num_heads=2, ffn_size=16)
    HFEsm2Model(shape).model.save_pretrained(checkpoint)
    run_dir = tmp_path / "run"
    result = train(run_dir, *HF_TINY, f"model.pretrained_path={checkpoint}")
    assert not warnings_printed(result), warnings_printed(result)  # e.g. modules in eval mode
    assert sorted(train_losses(run_dir)) == [1, 2]
    # The counts are host ints: no batch-transfer hook, so no Lightning warning about one.
    assert "transfer_batch_to_device" not in result.stdout + result.stderr
    resolved = (run_dir / "config.yaml").read_text()
    assert f"pretrained_path: {checkpoint}" in resolved
