"""``python train.py model=hf_esm2``: the end-to-end guarantee of test_train_e2e.py, built from
the config and loaded from a local checkpoint, offline, printing no warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bert_reduce.recipe.config import HFEsm2ModelConfig
from tests.helpers.recipe_runs import assert_same_rows, train, train_losses

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


def test_same_losses_for_every_split_built_or_loaded(tmp_path: Path) -> None:
    from bert_reduce.recipe.hf_esm import HFEsm2Model

    torch.manual_seed(0)
    checkpoint = tmp_path / "checkpoint"
    shape = HFEsm2ModelConfig(hidden_size=8, num_layers=1, num_heads=2, ffn_size=16)
    HFEsm2Model(shape).model.save_pretrained(checkpoint)
    # One multirun: micro-batches of 16 and 4, each built from the config and loaded. No run
    # warns: e.g. of modules in eval mode after from_pretrained, or of a batch-transfer hook.
    runs = {}
    for job in train(
        tmp_path / "sweep",
        *HF_TINY,
        "data.micro_batch_size=16,4",
        f"model.pretrained_path=null,{checkpoint}",
        multirun=True,
    ):
        cfg = OmegaConf.load(job / "config.yaml")
        runs[cfg.data.micro_batch_size, 1, cfg.model.pretrained_path] = job
    (runs[8, 2, str(checkpoint)],) = train(
        tmp_path / "ddp",
        *HF_TINY,
        "data.micro_batch_size=8",
        "trainer.devices=2",
        f"model.pretrained_path={checkpoint}",
    )
    assert len(runs) == 5
    for split, run_dir in runs.items():
        assert_same_rows(run_dir, runs[16, 1, split[2]], steps=[1, 2])
    # Loaded and built are different models: the comparisons above can fail.
    built, loaded = runs[16, 1, None], runs[16, 1, str(checkpoint)]
    assert train_losses(built)[1] != pytest.approx(train_losses(loaded)[1], rel=1e-5)
