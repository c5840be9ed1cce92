"""The recipe's callbacks with a real Trainer and real signals sent to this process."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from bert_reduce.recipe.callbacks import RunCheckpoint, StopOnSignal
from tests.helpers.recipe_runs import checkpoint_names, step_of
from tests.helpers.tiny_lightning import TinyModule, tiny_loader, tiny_trainer

pytestmark = pytest.mark.lightning24  # also run under NeMo's Lightning 2.4 (.ci/run)


def test_last_checkpoint_at_the_end_of_the_last_epoch(tmp_path: Path) -> None:
    # Periodic checkpoints and last.ckpt at step ends: test_a_checkpoint_is_put_in_place_...
    trainer = tiny_trainer(tmp_path, [RunCheckpoint(every_n_train_steps=0)], max_epochs=2)
    trainer.fit(TinyModule(), tiny_loader(), tiny_loader())
    # At the last batch of the last epoch, with that epoch not done.
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint_names(tmp_path / "checkpoints") == ["last.ckpt"]
    assert last["global_step"] == 12 and last["epoch"] == 1


def test_a_checkpoint_is_put_in_place_only_after_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = tiny_trainer(
        tmp_path, [RunCheckpoint(every_n_train_steps=2)], max_steps=7, val_check_interval=2
    )
    logger = trainer.logger
    replace = os.replace
    checked = []

    def checked_replace(source: str, target: str) -> None:
        if os.fspath(target).endswith(".ckpt"):
            step = step_of(Path(source))
            # Rows of steps 1..step, and the validations of steps 2, 4, ... up to step.
            assert logger.count("train_loss") >= step, (target, logger.rows)
            assert logger.count("val_loss") >= step // 2, (target, logger.rows)
            checked.append((Path(target).name, step))
        replace(source, target)

    monkeypatch.setattr(os, "replace", checked_replace)
    trainer.fit(TinyModule(), tiny_loader(), tiny_loader())
    assert checked == [
        ("step000002.ckpt", 2), ("last.ckpt", 2), ("step000004.ckpt", 4), ("last.ckpt", 4),
        ("step000006.ckpt", 6), ("last.ckpt", 6), ("last.ckpt", 7),
    ]  # fmt: skip
    assert not [name for name in checkpoint_names(tmp_path / "checkpoints") if ".tmp-" in name]


def test_keep_last_deletes_only_after_a_newer_one_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    replace = os.replace

    def recording_replace(source: str, target: str) -> None:
        replace(source, target)
        events.append(("in place", Path(target).name))

    class RecordingIO(TorchCheckpointIO):
        def remove_checkpoint(self, path: str) -> None:
            super().remove_checkpoint(path)
            events.append(("removed", Path(path).name))

    monkeypatch.setattr(os, "replace", recording_replace)
    trainer = tiny_trainer(
        tmp_path, [RunCheckpoint(every_n_train_steps=1, keep_last=2)], max_steps=4,
        plugins=[RecordingIO()],
    )  # fmt: skip
    trainer.fit(TinyModule(), tiny_loader(), tiny_loader())
    directory = tmp_path / "checkpoints"
    assert checkpoint_names(directory) == ["last.ckpt", "step000003.ckpt", "step000004.ckpt"]
    assert [e for e in events if e[1].startswith("step") and e[1].endswith(".ckpt")] == [
        ("in place", "step000001.ckpt"), ("in place", "step000002.ckpt"),
        ("in place", "step000003.ckpt"), ("removed", "step000001.ckpt"),
        ("in place", "step000004.ckpt"), ("removed", "step000002.ckpt"),
    ]  # fmt: skip
    # The list of kept checkpoints travels in the checkpoint: a resumed run goes on with it.
    callback = RunCheckpoint(every_n_train_steps=1, keep_last=2)
    trainer = tiny_trainer(tmp_path, [callback], max_steps=6)
    trainer.fit(TinyModule(), tiny_loader(), tiny_loader(), ckpt_path=directory / "last.ckpt")
    assert checkpoint_names(directory) == ["last.ckpt", "step000005.ckpt", "step000006.ckpt"]
    assert callback.periodic == [(5, "step000005.ckpt"), (6, "step000006.ckpt")]


def test_a_failure_before_the_rows_drops_the_pending_checkpoint(tmp_path: Path) -> None:
    def fail_in_validation_after_step_4(module: TinyModule) -> None:
        if module.trainer.global_step == 4:
            raise RuntimeError("validation failed")

    trainer = tiny_trainer(
        tmp_path, [RunCheckpoint(every_n_train_steps=2)], max_steps=8, val_check_interval=2
    )
    with pytest.raises(RuntimeError, match="validation failed"):
        module = TinyModule(in_validation_step=fail_in_validation_after_step_4)
        trainer.fit(module, tiny_loader(), tiny_loader())
    # Step 4's validation rows were never logged: its checkpoint is not in place, and no
    # temporary file is left (any failure but a stop at a step boundary drops them).
    directory = tmp_path / "checkpoints"
    assert checkpoint_names(directory) == ["last.ckpt", "step000002.ckpt"]
    assert step_of(directory / "last.ckpt") == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"keep_last": 0}, "keep_last=0: must be at least 1"), ({"every_n_train_steps": -1}, ">= 0")],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunCheckpoint(**kwargs)


class SignalAtStepEnd(Callback):
    def __init__(self, step: int, *signals: int) -> None:
        self.step = step
        self.signals = signals

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for signum in self.signals:
                os.kill(os.getpid(), signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_after_the_step_with_its_rows_and_checkpoint(
    tmp_path: Path, signum: int
) -> None:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stopper = StopOnSignal()
    trainer = tiny_trainer(
        tmp_path,
        [SignalAtStepEnd(3, signum), stopper, RunCheckpoint(every_n_train_steps=100)],
        max_steps=10,
        val_check_interval=3,
    )
    module = TinyModule()
    with pytest.raises(SIGTERMException) as raised:
        trainer.fit(module, tiny_loader(), tiny_loader())
    assert raised.value.code == 128 + signum
    assert stopper.stop_signal == signum
    assert module.training_steps == 3 and trainer.global_step == 3  # step 4 never started
    logger = trainer.logger
    assert logger.count("train_loss") == 3 and logger.count("val_loss") == 1  # step 3's too
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 3
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # put back by Lightning


def test_signal_during_validation_stops_after_the_next_step(tmp_path: Path) -> None:
    sent = []

    def signal_once_in_validation(module: TinyModule) -> None:
        if not sent:
            sent.append(module.trainer.global_step)
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = StopOnSignal()
    trainer = tiny_trainer(
        tmp_path, [stopper], max_steps=10, val_check_interval=2, enable_checkpointing=False
    )
    module = TinyModule(in_validation_step=signal_once_in_validation)
    with pytest.raises(SIGTERMException):
        trainer.fit(module, tiny_loader(), tiny_loader(num_samples=6))
    # The validation after step 2 runs to its end (all 3 batches, one val_loss row), then
    # step 3 runs and training stops after it.
    assert sent == [2]
    assert trainer.logger.count("val_loss") == 1
    assert module.training_steps == trainer.global_step == 3


def test_signal_at_the_last_step_ends_training_normally(tmp_path: Path) -> None:
    stopper = StopOnSignal()
    trainer = tiny_trainer(
        tmp_path, [SignalAtStepEnd(4, signal.SIGTERM), stopper], max_steps=4,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(TinyModule(), tiny_loader())
    assert stopper.stop_signal == signal.SIGTERM  # the entry point still exits with 143
    assert trainer.global_step == 4


def test_second_sigint_stops_at_once(tmp_path: Path) -> None:
    stopper = StopOnSignal()
    trainer = tiny_trainer(
        tmp_path,
        [SignalAtStepEnd(2, signal.SIGINT, signal.SIGINT), stopper, RunCheckpoint()],
        max_steps=10,
    )
    module = TinyModule()
    # Lightning's answer to KeyboardInterrupt: a graceful shutdown, then exit status 1.
    with pytest.raises(SystemExit) as raised:
        trainer.fit(module, tiny_loader())
    assert raised.value.code == 1
    assert module.training_steps == 2
    assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")


def draws() -> tuple:
    return (random.random(), np.random.rand(), torch.rand(3).tolist(), torch.randn(()).item())


def test_generator_states_travel_in_the_checkpoint(tmp_path: Path, caplog) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.randn()  # leaves a cached gaussian in NumPy's state
    callback = RunCheckpoint()
    torch.save(callback.state_dict(), tmp_path / "state.pt")
    expected = draws()
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # as Lightning loads it
    callback.load_state_dict(state)
    draws()  # what runs between loading and the first step (sanity check, loaders)
    trainer = SimpleNamespace(world_size=1, global_rank=0)
    callback.on_train_batch_start(trainer, None, None, 0)
    assert draws() == expected
    moved = draws()
    callback.on_train_batch_start(trainer, None, None, 1)  # only once
    assert draws() != moved
    # Another number of ranks: restore what it can, and say the masks will differ.
    callback.load_state_dict(state)
    callback.on_train_batch_start(SimpleNamespace(world_size=2, global_rank=1), None, None, 0)
    assert "random states of 1 rank(s), this run has 2" in caplog.text
