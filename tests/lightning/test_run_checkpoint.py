"""RunCheckpoint with a real Trainer: what is saved, when it is put in place, what is kept.

The property that makes a killed run resumable with every logged row once: a checkpoint is
renamed into place only after the rows of its step (training, and validation when due) were
handed to the loggers. Checked here at every rename, against Lightning's own logging.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from bert_reduce.lightning import RunCheckpoint
from tests.helpers.tiny_lightning import TinyModule, tiny_loader, tiny_trainer

pytestmark = pytest.mark.lightning24  # also run under NeMo's Lightning 2.4 (.ci/run)


def files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_periodic_and_last_checkpoints_at_step_ends(tmp_path: Path) -> None:
    callback = RunCheckpoint(every_n_train_steps=2)
    trainer = tiny_trainer(tmp_path, [callback], max_steps=5)  # 6 batches per epoch
    trainer.fit(TinyModule(), tiny_loader(), tiny_loader())
    directory = tmp_path / "checkpoints"
    assert files(directory) == ["last.ckpt", "step000002.ckpt", "step000004.ckpt"]
    assert [step_of(directory / name) for name in files(directory)] == [5, 2, 4]
    assert callback.periodic == [(2, "step000002.ckpt"), (4, "step000004.ckpt")]
    # max_epochs: last.ckpt at the last batch of the last epoch, with that epoch not done.
    callbacks = [RunCheckpoint(every_n_train_steps=0)]
    trainer = tiny_trainer(tmp_path / "epochs", callbacks, max_epochs=2)
    trainer.fit(TinyModule(), tiny_loader(), tiny_loader())
    last = torch.load(tmp_path / "epochs" / "checkpoints" / "last.ckpt", weights_only=False)
    assert files(tmp_path / "epochs" / "checkpoints") == ["last.ckpt"]
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
        if target.endswith(".ckpt"):
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
    assert not [name for name in files(tmp_path / "checkpoints") if ".tmp-" in name]


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
    assert files(directory) == ["last.ckpt", "step000003.ckpt", "step000004.ckpt"]
    assert [e for e in events if e[1] != "last.ckpt"] == [
        ("in place", "step000001.ckpt"), ("in place", "step000002.ckpt"),
        ("in place", "step000003.ckpt"), ("removed", "step000001.ckpt"),
        ("in place", "step000004.ckpt"), ("removed", "step000002.ckpt"),
    ]  # fmt: skip
    # The list of kept checkpoints travels in the checkpoint: a resumed run goes on with it.
    callback = RunCheckpoint(every_n_train_steps=1, keep_last=2)
    trainer = tiny_trainer(tmp_path, [callback], max_steps=6)
    trainer.fit(TinyModule(), tiny_loader(), tiny_loader(), ckpt_path=directory / "last.ckpt")
    assert files(directory) == ["last.ckpt", "step000005.ckpt", "step000006.ckpt"]
    assert callback.periodic == [(5, "step000005.ckpt"), (6, "step000006.ckpt")]


class RaiseAtStepStart(Callback):
    def __init__(self, step: int, exception: BaseException) -> None:
        self.step = step
        self.exception = exception

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise self.exception


def test_stop_at_a_step_boundary_completes_the_checkpoint(tmp_path: Path) -> None:
    # Lightning's preemption path: SIGTERMException after a step's logging (here at the start
    # of the next step, where StopOnSignal raises it), with that step's checkpoints pending.
    trainer = tiny_trainer(
        tmp_path,
        [RaiseAtStepStart(3, SIGTERMException(143)), RunCheckpoint(every_n_train_steps=3)],
        max_steps=10,
    )
    with pytest.raises(SIGTERMException):
        trainer.fit(TinyModule(), tiny_loader())
    assert files(tmp_path / "checkpoints") == ["last.ckpt", "step000003.ckpt"]
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 3
    # Any other failure at that point drops them: no file in place, no temporary file left.
    trainer = tiny_trainer(
        tmp_path / "other",
        [RaiseAtStepStart(3, RuntimeError("lost")), RunCheckpoint(every_n_train_steps=3)],
        max_steps=10,
    )
    with pytest.raises(RuntimeError, match="lost"):
        trainer.fit(TinyModule(), tiny_loader())
    assert files(tmp_path / "other" / "checkpoints") == []


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
    # temporary file is left.
    directory = tmp_path / "checkpoints"
    assert files(directory) == ["last.ckpt", "step000002.ckpt"]
    assert step_of(directory / "last.ckpt") == 2


def test_a_failed_write_names_the_file_and_the_cause(tmp_path: Path) -> None:
    class FullDiskAtStep4(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            if checkpoint["global_step"] == 4:
                Path(path).write_bytes(b"PK\x03\x04 half")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            super().save_checkpoint(checkpoint, path, storage_options)

    trainer = tiny_trainer(
        tmp_path, [RunCheckpoint(every_n_train_steps=2)], max_steps=8, plugins=[FullDiskAtStep4()]
    )
    directory = tmp_path / "checkpoints"
    with pytest.raises(OSError, match="No space left on device") as raised:
        trainer.fit(TinyModule(), tiny_loader())
    assert raised.value.errno == errno.ENOSPC
    assert f"Could not write the checkpoint {directory / 'step000004.ckpt'} (step 4)" in str(
        raised.value
    )
    assert files(directory) == ["last.ckpt", "step000002.ckpt"]  # as they were, nothing else
    assert step_of(directory / "last.ckpt") == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"keep_last": 0}, "keep_last=0: must be at least 1"), ({"every_n_train_steps": -1}, ">= 0")],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunCheckpoint(**kwargs)
