"""StopOnSignal with a real Trainer and real signals sent to this process.

A signal stops training at the next step boundary: the step in progress finishes, is logged
(and validated, when due), RunCheckpoint puts its ``last.ckpt`` in place, and no work of the
next step starts. A second ``SIGINT`` stops at once.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from bert_reduce.lightning import RunCheckpoint, StopOnSignal
from tests.helpers.tiny_lightning import TinyModule, tiny_loader, tiny_trainer

pytestmark = pytest.mark.lightning24  # also run under NeMo's Lightning 2.4 (.ci/run)


class SignalAtStepEnd(Callback):
    """Sends ``signals`` to this process at the end of training step ``step``."""

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
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3
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
