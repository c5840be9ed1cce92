"""``TEST_FAULT=<kind>@<step> python -m tests.helpers.faults <train.py overrides>``.

Runs ``train.py`` in this process (other ranks' processes run without the fault) with, at
training step ``<step>``:

* ``kill-after-checkpoint-write``: ``SIGKILL`` once the step's checkpoints are written, before
  its training row (where a checkpoint renamed into place at once would be ahead of
  ``metrics.csv``);
* ``kill-after-train-row``: ``SIGKILL`` once its training row is in ``metrics.csv``;
* ``kill-mid-commit``: ``SIGKILL`` once its periodic checkpoint is in place, before ``last.ckpt``;
* ``kill-after-commit``: ``SIGKILL`` once its checkpoints are in place;
* ``enospc``: ``write`` fails with ``ENOSPC`` after 64 KiB of its checkpoint, as on a full file
  system (``torch.save`` then raises its own ``RuntimeError``, as on a real full disk).

The library has no fault hooks: only this helper patches it.
"""

from __future__ import annotations

import errno
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

from bert_reduce.recipe import files
from bert_reduce.recipe.callbacks import LAST_NAME, RunCheckpoint
from bert_reduce.recipe.csv_logger import AppendingCSVLogger

ROOT = Path(__file__).resolve().parents[2]
KINDS = (
    "kill-after-checkpoint-write",
    "kill-after-train-row",
    "kill-mid-commit",
    "kill-after-commit",
    "enospc",
)
_current_step = -1  # the training step whose checkpoint RunCheckpoint last handled


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FillingFile:
    """A binary file that takes ``room`` more bytes, then fails as a full disk does."""

    def __init__(self, handle: Any, room: int) -> None:
        self.handle = handle
        self.room = room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.handle.write(bytes(data)[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> FillingFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.handle.close()


def install(kind: str, step: int) -> None:
    """Patch the library so that ``kind`` happens at training step ``step``."""
    if kind not in KINDS:
        raise ValueError(f"TEST_FAULT kind {kind!r}: one of {KINDS}")
    batch_end = RunCheckpoint.on_train_batch_end

    def on_train_batch_end(self: RunCheckpoint, trainer: Any, *args: Any) -> None:
        global _current_step
        _current_step = trainer.global_step
        batch_end(self, trainer, *args)
        if kind == "kill-after-checkpoint-write" and _current_step == step:
            _kill()

    RunCheckpoint.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]

    if kind == "kill-after-train-row":
        save = AppendingCSVLogger.save

        def save_then_kill(self: AppendingCSVLogger) -> None:
            rows = list(self._rows)
            save(self)
            if any(row.get("train_loss") is not None and row["step"] == step for row in rows):
                _kill()

        AppendingCSVLogger.save = save_then_kill  # type: ignore[method-assign]
    elif kind == "kill-mid-commit":
        replace = os.replace

        def replace_then_kill(source: Any, target: Any) -> None:
            replace(source, target)
            name = os.path.basename(os.fspath(target))
            if name.endswith(".ckpt") and name != LAST_NAME and _current_step == step:
                _kill()

        os.replace = replace_then_kill
    elif kind == "kill-after-commit":
        commit = RunCheckpoint.commit

        def commit_then_kill(self: RunCheckpoint, trainer: Any) -> None:
            pending = bool(self._pending)
            commit(self, trainer)
            if pending and _current_step == step:
                _kill()

        RunCheckpoint.commit = commit_then_kill  # type: ignore[method-assign]
    elif kind == "enospc":

        def filling_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = open(file, mode, *args, **kwargs)
            if mode == "wb" and _current_step == step:
                return FillingFile(handle, room=64 * 1024)
            return handle

        files.open = filling_open  # type: ignore[attr-defined]  # the module's open only


def main() -> None:
    kind, step = os.environ["TEST_FAULT"].split("@")
    install(kind, int(step))
    sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
