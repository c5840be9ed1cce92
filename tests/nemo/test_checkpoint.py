"""NeMo checkpointing with bert_reduce's loss: io.json records it, resume is exact.

The recipe of ``examples/nemo2_recipe.py`` (``llm.pretrain``) with NeMo's ``ModelCheckpoint``
runs 2 of 3 steps on 2 gloo processes (DP=2); NeMo's io context (``context/io.json``) records
the model's constructor arguments, the loss class and its options included, and
``load_context`` rebuilds them. A second run resumes from the checkpoint (``AutoResume``) and
does step 3: its loss and the final weights equal the uninterrupted one-process reference.
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
from tests.nemo.test_fit import STEPS, _assert_matches_reference
from tests.nemo.test_recipe import _recipe
from tests.nemo.tiny_bert import TinyBertMLM, reference_training, run_processes, scratch_dir


def _checkpointed_run(out_dir: str, max_steps: int, resume_from: str | None) -> None:
    recipe = _recipe(out_dir, devices=2)
    recipe.trainer.max_steps = max_steps
    recipe.trainer.enable_checkpointing = True
    recipe.log.ckpt = run.Config(
        nl.ModelCheckpoint,
        every_n_train_steps=1,
        monitor="reduced_train_loss",
        save_top_k=1,
        save_last=True,
    )
    recipe.model.loss_reduction_class = run.Partial(
        BERTMLMLossWithReduction, mask_capacity=0.5
    )
    if resume_from is not None:
        recipe.resume = run.Config(
            nl.AutoResume, resume_from_path=resume_from, resume_if_exists=True
        )
    with megatron_on_cpu():
        run.run(recipe, direct=True)


def _checkpoint_of_step(root: Path, step: int) -> Path:
    found = [p for p in root.rglob(f"*step={step - 1}*") if (p / "context").is_dir()]
    assert len(found) == 1, sorted(root.rglob("*"))
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_records_the_loss_and_resume_is_exact() -> None:
    with single_process_megatron(), megatron_on_cpu():
        reference = reference_training(STEPS)
    with scratch_dir() as first, scratch_dir() as second:
        run_processes(_checkpointed_run, 2, first, STEPS - 1, None)
        first_losses = torch.load(Path(first) / "rank0.pt")["losses"]
        checkpoint = _checkpoint_of_step(Path(first), STEPS - 1)

        io_json = (checkpoint / "context" / "io.json").read_text()
        assert "bert_reduce.reduction.BERTMLMLossWithReduction" in io_json
        model = load_context(checkpoint / "context", subpath="model")
        assert isinstance(model, TinyBertMLM)
        assert isinstance(model.loss_reduction_class, functools.partial)
        assert model.loss_reduction_class.func is BERTMLMLossWithReduction
        assert model.loss_reduction_class.keywords == {"mask_capacity": 0.5}
        assert model.training_loss_reduction().mask_capacity == 0.5

        run_processes(_checkpointed_run, 2, second, STEPS, str(checkpoint))
        resumed = [torch.load(Path(second) / f"rank{r}.pt") for r in range(2)]
    # The resumed run logged step 3 only; together with the first run, every step is exact.
    for result in resumed:
        result["losses"] = first_losses + result["losses"]
    _assert_matches_reference(resumed, reference)
