"""A NeMo 2 recipe (``run.Partial`` of ``llm.pretrain``) with bert_reduce's loss, executed.

``examples/nemo2_recipe.py`` builds the recipe as fiddle configs, the loss class and its
options included (``run.Partial(BERTMLMLossWithReduction, ...)``); ``nemo_run`` executes it
in-process (``direct=True``) on 2 gloo processes (DP=2). The fit's losses and weights equal the
one-process PyTorch reference, as in ``test_fit.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl
import nemo_run as run
import torch
from nemo import lightning as nl

from bert_reduce import BERTMLMLossWithReduction
from examples.nemo2_recipe import mlm_pretrain_recipe
from tests.helpers.megatron_cpu import single_process_megatron
from tests.nemo.cpu_stand_ins import megatron_on_cpu
from tests.nemo.fit_helpers import ResultSaver
from tests.nemo.test_fit import STEPS, _assert_matches_reference
from tests.nemo.tiny_bert import (
    CLIP_GRAD,
    LR,
    MOMENTUM,
    TinyBertDataModule,
    TinyBertMLM,
    reference_training,
    run_processes,
    scratch_dir,
    tiny_bert_config,
)


def _recipe(out_dir: str, devices: int) -> run.Partial:
    return mlm_pretrain_recipe(
        model=run.Config(TinyBertMLM, config=run.Config(tiny_bert_config)),
        data=run.Config(TinyBertDataModule, steps=STEPS),
        devices=devices,
        accelerator="cpu",
        max_steps=STEPS,
        log_dir=str(Path(out_dir) / "nemo_experiments"),
        loss_options={"mask_capacity": "all"},
        optimizer_options={
            "optimizer": "sgd",
            "lr": LR,
            "sgd_momentum": MOMENTUM,
            "weight_decay": 0.0,
            "clip_grad": CLIP_GRAD,
        },
        trainer_options={
            "callbacks": [run.Config(ResultSaver, out_dir=out_dir)],
            "plugins": run.Config(nl.MegatronMixedPrecision, precision="32"),
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_checkpointing": False,
        },
    )


def _run_recipe(out_dir: str, devices: int) -> None:
    with megatron_on_cpu():
        run.run(_recipe(out_dir, devices), direct=True)


def test_recipe_configures_the_loss_and_the_megatron_flags() -> None:
    recipe = _recipe("unused", devices=2)
    assert recipe.model.config.calculate_per_token_loss is True
    assert recipe.trainer.strategy.ddp.average_in_collective is False
    loss_class = fdl.build(recipe.model.loss_reduction_class)
    loss = loss_class(validation_step=True)
    assert isinstance(loss, BERTMLMLossWithReduction)
    assert loss.validation_step and loss.mask_capacity == "all"


@pytest.mark.slow
def test_recipe_runs_and_equals_pytorch() -> None:
    with single_process_megatron(), megatron_on_cpu():
        reference = reference_training(STEPS)
    with scratch_dir() as out_dir:
        run_processes(_run_recipe, 2, out_dir, 2)
        results = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(2)]
    _assert_matches_reference(results, reference)
