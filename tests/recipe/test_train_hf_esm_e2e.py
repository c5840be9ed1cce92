"""``python train.py model=hf_esm2``: Hugging Face's EsmForMaskedLM through the exact loss.

As for the default model (test_train_e2e.py): the same global batches give the same
per-step ``train_loss`` and final ``val_loss``/``val_ppl`` whatever the micro-batch size and
number of DDP processes, for a model built from the config and one loaded from a local
checkpoint; offline (``HF_HUB_OFFLINE=1``), printing no warning.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bert_reduce.recipe.config import HFEsm2ModelConfig
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
WARNINGS_SHOWN = {"PYTHONWARNINGS": "default", "HF_HUB_OFFLINE": "1"}


def test_same_losses_for_every_split_built_or_loaded(tmp_path: Path) -> None:
    from bert_reduce.recipe.hf_esm import HFEsm2Model

    torch.manual_seed(0)
    checkpoint = tmp_path / "checkpoint"
    shape = HFEsm2ModelConfig(hidden_size=8, num_layers=1, num_heads=2, ffn_size=16)
    HFEsm2Model(shape).model.save_pretrained(checkpoint)
    # One multirun: micro-batches of 16 and 4, each built from the config and loaded.
    sweep = tmp_path / "sweep"
    outputs = [
        train(
            sweep,
            *HF_TINY,
            "data.micro_batch_size=16,4",
            f"model.pretrained_path=null,{checkpoint}",
            multirun=True,
            env=WARNINGS_SHOWN,
        )
    ]
    runs = {}
    for job in (path for path in sweep.iterdir() if path.name.isdigit()):
        cfg = OmegaConf.load(job / "config.yaml")
        runs[cfg.data.micro_batch_size, 1, cfg.model.pretrained_path] = job
    runs[8, 2, str(checkpoint)] = tmp_path / "ddp"
    outputs.append(
        train(
            runs[8, 2, str(checkpoint)],
            *HF_TINY,
            "data.micro_batch_size=8",
            "trainer.devices=2",
            f"model.pretrained_path={checkpoint}",
            env=WARNINGS_SHOWN,
        )
    )
    for result in outputs:
        # E.g. modules in eval mode after from_pretrained; and the counts are host ints: no
        # batch-transfer hook, so no Lightning warning about one.
        assert not warnings_printed(result), warnings_printed(result)
        assert "transfer_batch_to_device" not in result.stdout + result.stderr
    assert len(runs) == 5
    for pretrained in (None, str(checkpoint)):
        reference = runs[16, 1, pretrained]
        ref_losses, ref_val = train_losses(reference), validations(reference)
        assert sorted(ref_losses) == [1, 2] and sorted(ref_val) == [2]
        assert ref_losses[1] != ref_losses[2]
        for split, run_dir in runs.items():
            if split[2] != pretrained:
                continue
            losses = train_losses(run_dir)
            for step, loss in ref_losses.items():
                assert losses[step] == pytest.approx(loss, rel=1e-5), (split, step)
            (val_loss, val_ppl), (ref_loss, ref_ppl) = validations(run_dir)[2], ref_val[2]
            assert val_ppl == pytest.approx(ref_ppl, rel=1e-5), split
            assert val_loss == pytest.approx(ref_loss, rel=1e-5), split
    # Loaded and built are different models: the comparisons above can fail.
    built, loaded = runs[16, 1, None], runs[16, 1, str(checkpoint)]
    assert train_losses(built)[1] != pytest.approx(train_losses(loaded)[1], rel=1e-5)
