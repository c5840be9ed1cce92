"""``examples/nemo2_recipe.py``: it configures the loss and flags; checkpoints record the loss
in io.json, and resume is exact.

The recipe runs in-process on 2 gloo processes with NeMo's ``ModelCheckpoint`` and Adam, then
again resumed from step 2 (``AutoResume``).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl
import nemo_run as run
import torch
from nemo import lightning as nl
from nemo.lightning.io import load_context

from bert_reduce import BERTMLMLossWithReduction
from tests.helpers.dist_utils import load_rank_results, run_launched
from tests.helpers.megatron_cpu import megatron_on_cpu
from tests.helpers.nemo_bert import STEPS, TinyBertMLM, recipe, reference_training
from tests.helpers.reference import assert_close_by_name

ADAM_LR = 0.01


def test_recipe_configures_the_loss_and_the_megatron_flags() -> None:
    configured = recipe("unused", devices=2)
    assert configured.model.config.calculate_per_token_loss is True
    assert configured.trainer.strategy.ddp.average_in_collective is False
    loss = fdl.build(configured.model.loss_reduction_class)(validation_step=True)
    assert isinstance(loss, BERTMLMLossWithReduction)
    assert loss.validation_step and loss.options.capacity == "all"


def _checkpointed_run(out_dir: str, resume_from: str | None) -> None:
    configured = recipe(out_dir, devices=2)
    configured.trainer.enable_checkpointing = True
    configured.trainer.enable_progress_bar = False
    # Synchronous: NeMo's default asynchronous save deadlocks on gloo (docs/nemo.md).
    configured.trainer.strategy.ckpt_async_save = False
    configured.log.ckpt = run.Config(
        nl.ModelCheckpoint,
        filename="ckpt-{step}",
        every_n_train_steps=1,
        monitor="reduced_train_loss",
        save_top_k=-1,  # keep every step's: the end's holds no optimizer state
        save_last=False,
    )
    # Adam: Megatron cannot reload SGD's optimizer state (docs/nemo.md).
    configured.optim.config.optimizer = "adam"
    configured.optim.config.lr = ADAM_LR
    configured.model.loss_reduction_class = run.Partial(BERTMLMLossWithReduction, capacity=0.5)
    if resume_from is not None:
        configured.resume = run.Config(
            nl.AutoResume, resume_from_path=resume_from, resume_if_exists=True
        )
    with megatron_on_cpu():
        run.run(configured, direct=True)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two NeMo runs of 2 processes each
def test_checkpoint_records_the_loss_and_resume_is_exact() -> None:
    ref_losses = torch.tensor(reference_training(adam_lr=ADAM_LR)[0], dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        whole, resumed = Path(tmp) / "whole", Path(tmp) / "resumed"
        for out_dir in (whole, resumed):
            out_dir.mkdir()
        run_launched(_checkpointed_run, 2, str(whole), None)
        # NeMo logs `step` before the optimizer step: step=1 names the checkpoint after two.
        (checkpoint,) = (p for p in whole.rglob("ckpt-step=1") if (p / "context").is_dir())

        io_json = (checkpoint / "context" / "io.json").read_text()
        loss_ref = '"module": "bert_reduce.reduction", "name": "BERTMLMLossWithReduction"'
        assert loss_ref in io_json and "capacity" in io_json
        model = load_context(checkpoint / "context", subpath="model")
        assert isinstance(model, TinyBertMLM)
        assert isinstance(model.loss_reduction_class, functools.partial)
        assert model.loss_reduction_class.func is BERTMLMLossWithReduction
        assert model.loss_reduction_class.keywords == {"capacity": 0.5}
        assert model.training_loss_reduction().options.capacity == 0.5

        run_launched(_checkpointed_run, 2, str(resumed), str(checkpoint))
        resumed_ranks, uninterrupted = load_rank_results(resumed, 2), load_rank_results(whole, 2)
    for result, expected in zip(resumed_ranks, uninterrupted, strict=True):
        # The uninterrupted recipe run logged the reference's loss at every step.
        torch.testing.assert_close(torch.tensor(expected["losses"]), ref_losses, rtol=1e-6, atol=0)
        # The resumed run logged step 3 only, the uninterrupted run's.
        assert result["losses"] == expected["losses"][STEPS - 1 :]
        # Adam turns the rounding noise of gradients that are zero in exact arithmetic (the
        # key bias) into visible steps, so the weights are compared with the uninterrupted
        # NeMo run, which does the same arithmetic, rather than with the reference.
        assert_close_by_name(result["params"], expected["params"], rtol=0, atol=0)
