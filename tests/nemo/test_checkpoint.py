"""NeMo checkpointing with bert_reduce's loss: io.json records it, resume is exact.

The recipe of ``examples/nemo2_recipe.py`` (``llm.pretrain``) with NeMo's ``ModelCheckpoint``
runs 2 of 3 steps with Adam on 2 gloo processes (DP=2); NeMo's io context
(``context/io.json``) records the model's constructor arguments, the loss class and its
options included, and ``load_context`` rebuilds them. A second run resumes from the
checkpoint (``AutoResume``; the data module stores its consumed samples, as NeMo's
``PreTrainingDataModule`` does) and does step 3: every step's loss equals the one-process
reference, and losses and weights equal those of an uninterrupted NeMo run bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

pytest.importorskip("nemo_run")

import nemo_run as run
import torch
from nemo import lightning as nl
from nemo.lightning.io import load_context

from bert_reduce import BERTMLMLossWithReduction
from tests.helpers.megatron_cpu import single_process_megatron
from tests.nemo.cpu_stand_ins import megatron_on_cpu
from tests.nemo.test_fit import STEPS
from tests.nemo.test_recipe import _recipe
from tests.nemo.tiny_bert import TinyBertMLM, reference_training, run_processes, scratch_dir

ADAM_LR = 0.01


def _checkpointed_run(out_dir: str, max_steps: int, resume_from: str | None) -> None:
    recipe = _recipe(out_dir, devices=2)
    recipe.trainer.max_steps = max_steps
    recipe.trainer.enable_checkpointing = True
    recipe.trainer.enable_progress_bar = False
    # NeMo saves asynchronously by default: on gloo its background save and the checkpoint
    # callback's broadcasts deadlock; a synchronous save is what is checked here.
    recipe.trainer.strategy.ckpt_async_save = False
    recipe.log.ckpt = run.Config(
        nl.ModelCheckpoint,
        every_n_train_steps=1,
        monitor="reduced_train_loss",
        save_top_k=1,
        save_last=True,
        save_optim_on_train_end=True,  # the -last checkpoint is written at the end of the fit
    )
    # Adam: Megatron's optimizer state of SGD cannot be reloaded (no init_state_fn for SGD in
    # megatron/core/optimizer/__init__.py), Adam's can.
    recipe.optim.config.optimizer = "adam"
    recipe.optim.config.lr = ADAM_LR
    recipe.model.loss_reduction_class = run.Partial(
        BERTMLMLossWithReduction, mask_capacity=0.5
    )
    if resume_from is not None:
        recipe.resume = run.Config(
            nl.AutoResume, resume_from_path=resume_from, resume_if_exists=True
        )
    with megatron_on_cpu():
        run.run(recipe, direct=True)


def _last_checkpoint(root: Path) -> Path:
    """The ``...-last`` checkpoint NeMo's ``ModelCheckpoint(save_last=True)`` wrote."""
    found = [p for p in root.rglob("*-last") if (p / "context").is_dir()]
    assert len(found) == 1, sorted(root.rglob("*"))
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_records_the_loss_and_resume_is_exact() -> None:
    with single_process_megatron(), megatron_on_cpu():
        ref_losses, _ = reference_training(STEPS, adam_lr=ADAM_LR)
    with scratch_dir() as first, scratch_dir() as second, scratch_dir() as whole:
        run_processes(_checkpointed_run, 2, first, STEPS - 1, None)
        first_losses = torch.load(Path(first) / "rank0.pt")["losses"]
        checkpoint = _last_checkpoint(Path(first))

        io_json = (checkpoint / "context" / "io.json").read_text()
        loss_ref = '"module": "bert_reduce.reduction", "name": "BERTMLMLossWithReduction"'
        assert loss_ref in io_json and "mask_capacity" in io_json
        model = load_context(checkpoint / "context", subpath="model")
        assert isinstance(model, TinyBertMLM)
        assert isinstance(model.loss_reduction_class, functools.partial)
        assert model.loss_reduction_class.func is BERTMLMLossWithReduction
        assert model.loss_reduction_class.keywords == {"mask_capacity": 0.5}
        assert model.training_loss_reduction().mask_capacity == 0.5

        run_processes(_checkpointed_run, 2, second, STEPS, str(checkpoint))
        run_processes(_checkpointed_run, 2, whole, STEPS, None)
        resumed = [torch.load(Path(second) / f"rank{r}.pt") for r in range(2)]
        uninterrupted = [torch.load(Path(whole) / f"rank{r}.pt") for r in range(2)]
    for result, expected in zip(resumed, uninterrupted, strict=True):
        # The resumed run logged step 3 only; with the first run's, every step's loss.
        losses = torch.tensor(first_losses + result["losses"])
        torch.testing.assert_close(losses, torch.tensor(expected["losses"]), rtol=0, atol=0)
        torch.testing.assert_close(
            losses, torch.tensor(ref_losses, dtype=torch.float32), rtol=1e-6, atol=0
        )
        # Adam turns the rounding noise of gradients that are zero in exact arithmetic (the
        # key bias) into visible steps, so the weights are compared with the uninterrupted
        # NeMo run, which does the same arithmetic, rather than with the reference.
        assert result["params"].keys() == expected["params"].keys()
        for name, value in result["params"].items():
            torch.testing.assert_close(value, expected["params"][name], rtol=0, atol=0)
