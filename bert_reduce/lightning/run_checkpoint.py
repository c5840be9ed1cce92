"""Checkpoints at the end of training steps, put in place once the step's metrics are logged.

Two orderings make a run that is killed at any instant (``kill -9``, the out-of-memory
killer, a lost node) resumable with every logged row exactly once:

* A checkpoint is taken only at the end of a training step, the one point where resume is
  exact. Lightning's ``ModelCheckpoint`` also saves after validation, at the end of a
  training epoch and when training ends, with the loops in other states: a ``last.ckpt``
  written when training stops at ``max_steps`` in the middle of an epoch records that epoch
  as finished, so a run resumed from it skips the rest of the unfinished epoch.
* Lightning logs a step's metrics *after* the step's checkpoint callbacks run, and validates
  after that. A checkpoint renamed into place at once can therefore be newer than the
  metrics file: a kill in between loses the step's rows for good (the resumed run starts
  after them). :class:`RunCheckpoint` writes the step's checkpoint under a temporary name
  (``<name>.tmp-<pid>``) and renames it into place only at the next step boundary (the next
  step's start, the end of training, or a stop at a step boundary), after asking the loggers
  to save: a checkpoint in place never lies ahead of the logged rows. A resumed run drops the
  rows logged after its checkpoint's step and logs them again.

Retention: ``keep_last=N`` keeps the ``N`` newest periodic checkpoints and deletes older ones,
and only once a newer checkpoint is in place, so what a resume needs is never deleted.
``last.ckpt`` is always the directory's latest state (never ``last-v1.ckpt``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import lightning.pytorch as pl
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from bert_reduce.lightning.stop_on_signal import StopOnSignal

__all__ = ["LAST_NAME", "RunCheckpoint", "temporary_name"]

LAST_NAME = "last.ckpt"
"""The checkpoint of the latest step of the run."""


def temporary_name(path: str | os.PathLike[str]) -> str:
    """Where ``path`` is written before it is renamed into place: ``<path>.tmp-<pid>``."""
    return f"{os.fspath(path)}.tmp-{os.getpid()}"


def _fsync(path: str) -> None:
    """Flush a file or a directory entry to the disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


class RunCheckpoint(Checkpoint):
    """Periodic and ``last.ckpt`` checkpoints at step ends, in place once the step is logged.

    Args:
        dirpath: Where checkpoints go (``<default_root_dir>/checkpoints`` when ``None``).
        filename: Name of the periodic checkpoints, formatted with ``step`` and ``epoch``
            (``"step{step:06d}"`` gives ``step000100.ckpt``).
        every_n_train_steps: Save a periodic checkpoint every this many optimizer steps (0:
            never).
        keep_last: How many periodic checkpoints to keep, the newest (``None``: all).
        save_last: Also keep ``last.ckpt``: with every periodic checkpoint and at the last
            step (``max_steps``, the last batch of ``max_epochs``, or a stop requested by a
            signal, ``trainer.should_stop`` or :class:`~bert_reduce.lightning.StopOnSignal`).

    Raises:
        ValueError: If ``every_n_train_steps`` is negative or ``keep_last`` is below 1.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str = "step{step:06d}",
        every_n_train_steps: int = 100,
        keep_last: int | None = None,
        save_last: bool = True,
    ) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps={every_n_train_steps}: must be >= 0.")
        if keep_last is not None and keep_last < 1:
            raise ValueError(
                f"keep_last={keep_last}: must be at least 1 (the newest periodic checkpoint), "
                "or None to keep every one."
            )
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps
        self.keep_last = keep_last
        self.save_last = save_last
        self.periodic: list[tuple[int, str]] = []  # (step, file name), oldest first
        self._pending: list[tuple[str, str]] = []  # (temporary path, final path)
        self._last_saved_step: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        # Every rank must name the same files: rank 0's choice.
        self.dirpath = trainer.strategy.broadcast(self.dirpath)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"periodic": [[step, name] for step, name in self.periodic]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.periodic = [(int(step), str(name)) for step, name in state_dict["periodic"]]

    @staticmethod
    def _is_last_step(trainer: pl.Trainer, batch_idx: int) -> bool:
        stop_requested = any(
            isinstance(callback, StopOnSignal) and callback.stop_signal is not None
            for callback in trainer.callbacks
        )
        if stop_requested or trainer.should_stop or trainer.received_sigterm:
            return True
        if 0 <= trainer.max_steps <= trainer.global_step:
            return True
        max_epochs = trainer.max_epochs
        return (
            max_epochs is not None
            and max_epochs >= 0
            and trainer.current_epoch + 1 >= max_epochs
            and batch_idx + 1 >= trainer.num_training_batches
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check that every rank starts at the same step.

        Raises:
            RuntimeError: If they do not: each rank read its own checkpoint (Lightning loads
                ``ckpt_path`` on every rank), and they were not the same step's.
        """
        if trainer.world_size > 1:
            # torch's own gather of Python objects: Lightning's strategy.all_gather goes through
            # torch.distributed.nn.functional.all_gather, which torch 2.13 deprecates with a
            # warning the user cannot act on.
            steps: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(steps, trainer.global_step)
            if len(set(steps)) > 1:
                raise RuntimeError(
                    f"The ranks start training at different steps ({steps}, by rank): they "
                    "resumed from different checkpoints. Give every rank the same checkpoint "
                    "file (a file system that all nodes see alike)."
                )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Put the previous step's checkpoints in place: its rows are logged by now."""
        self.commit(trainer)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Write this step's checkpoints under temporary names (every rank takes part).

        Raises:
            OSError: If writing fails (a full disk, say), naming the checkpoint and the cause;
                the checkpoints in place are untouched and no temporary file is left.
        """
        step = trainer.global_step
        if step == 0 or step == self._last_saved_step:
            return
        periodic = self.every_n_train_steps > 0 and step % self.every_n_train_steps == 0
        last = self.save_last and (periodic or self._is_last_step(trainer, batch_idx))
        if not (periodic or last):
            return
        assert self.dirpath is not None, "RunCheckpoint.setup() sets dirpath"
        # last.ckpt last: it is renamed into place after the periodic checkpoint of its step,
        # so a last.ckpt in place says that its step's checkpoints are all in place.
        names = []
        if periodic:
            name = self.filename.format(step=step, epoch=trainer.current_epoch) + ".ckpt"
            self.periodic.append((step, name))  # before saving: its own state lists it
            names.append(name)
        if last:
            names.append(LAST_NAME)
        finals = [os.path.join(self.dirpath, name) for name in names]
        self._pending = [(temporary_name(final), final) for final in finals]
        self._last_saved_step = step
        writing = finals[0]
        try:
            trainer.save_checkpoint(self._pending[0][0], weights_only=False)
            if trainer.is_global_zero:
                for temporary, final in self._pending[1:]:
                    writing = final
                    # A copy, not a link: a fault that damages one file leaves the other.
                    shutil.copyfile(self._pending[0][0], temporary)
                    if isinstance(get_filesystem(temporary), LocalFileSystem):
                        _fsync(temporary)
        except OSError as error:
            self._discard(trainer)
            raise OSError(
                error.errno,
                f"Could not write the checkpoint {writing} (step {step}): "
                f"{error.strerror or error}. The checkpoints already in {self.dirpath} and the "
                "metrics logged so far are as they were: fix the cause (free disk space, say) "
                "and resume from them.",
            ) from error

    def commit(self, trainer: pl.Trainer) -> None:
        """Rename the pending checkpoints into place, then apply ``keep_last``.

        Call it only once the pending step's metrics are logged. The loggers save first, so
        that (on rank 0, which alone writes files) a checkpoint in place is never ahead of
        the metrics on disk.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
            for temporary, final in pending:
                filesystem = get_filesystem(final)
                if isinstance(filesystem, LocalFileSystem):
                    os.replace(temporary, final)
                else:
                    filesystem.mv(temporary, final)
            if isinstance(get_filesystem(pending[0][1]), LocalFileSystem):
                _fsync(os.path.dirname(pending[0][1]) or ".")
        self._remove_old(trainer)

    def _remove_old(self, trainer: pl.Trainer) -> None:
        # Every rank keeps the same list; the strategy deletes on rank 0 only.
        if self.keep_last is None or len(self.periodic) <= self.keep_last:
            return
        assert self.dirpath is not None
        old, self.periodic = self.periodic[: -self.keep_last], self.periodic[-self.keep_last :]
        for _, name in old:
            path = os.path.join(self.dirpath, name)
            if trainer.is_global_zero and get_filesystem(path).exists(path):
                trainer.strategy.remove_checkpoint(path)

    def _discard(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, []
        if trainer.is_global_zero:
            for temporary, _ in pending:
                filesystem = get_filesystem(temporary)
                if filesystem.exists(temporary):
                    filesystem.rm_file(temporary)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the last step's checkpoints in place: its rows and validation are logged."""
        self.commit(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Complete the pending checkpoints on a stop at a step boundary, else drop them.

        Lightning (and :class:`~bert_reduce.lightning.StopOnSignal`) raise
        ``SIGTERMException`` outside validation only after a step's logging and validation:
        its rows are complete. Any other failure may have cut them short.
        """
        at_step_boundary = isinstance(exception, SIGTERMException) and not (
            trainer.validating or trainer.sanity_checking
        )
        if at_step_boundary:
            self.commit(trainer)
        else:
            self._discard(trainer)
