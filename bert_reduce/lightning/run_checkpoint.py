"""Checkpoints taken only at the end of a training step, the one point where resume is exact.

Lightning's ``ModelCheckpoint`` also saves ``last.ckpt`` after validation, at the end of a
training epoch and when training ends. Those are taken with the loops in other states: a
``last.ckpt`` written when training stops at ``max_steps`` in the middle of an epoch records
that epoch as finished, so a run resumed from it (to train more steps) starts the next
epoch's order and skips the rest of the unfinished one. :class:`RunCheckpoint` keeps the
periodic ``every_n_train_steps`` saves and adds ``last.ckpt`` at the last step (``max_steps``,
the last batch of ``max_epochs``, or a stop requested by a signal), all at the end of a step,
and never writes ``last-v1.ckpt``: in a run directory, ``last.ckpt`` is its latest state.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["RunCheckpoint"]


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` saving at the end of training steps only, ``last.ckpt`` at the last.

    Args:
        dirpath: Where checkpoints go (``<default_root_dir>/checkpoints`` when ``None``).
        filename: ``ModelCheckpoint``'s file name pattern, e.g. ``"step{step:06d}"``.
        every_n_train_steps: Save ``filename`` every this many optimizer steps (0: never).
        save_top_k: How many periodic checkpoints to keep (``-1``: all).
        save_last: Also keep ``last.ckpt``: after every periodic save and at the last step.
        auto_insert_metric_name: ``ModelCheckpoint``'s option of the same name.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "step{step:06d}",
        every_n_train_steps: int = 100,
        save_top_k: int = -1,
        save_last: bool = True,
        auto_insert_metric_name: bool = False,
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            every_n_train_steps=every_n_train_steps,
            save_top_k=save_top_k,
            save_last=save_last,
            auto_insert_metric_name=auto_insert_metric_name,
            enable_version_counter=False,
            save_on_train_epoch_end=False,
        )

    @staticmethod
    def _is_last_step(trainer: pl.Trainer) -> bool:
        if trainer.received_sigterm or trainer.should_stop:
            return True
        if 0 <= trainer.max_steps <= trainer.global_step:
            return True
        max_epochs = trainer.max_epochs
        return (
            max_epochs is not None
            and max_epochs >= 0
            and trainer.current_epoch + 1 >= max_epochs
            and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        )

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Periodic save, then ``last.ckpt`` at the last step if not saved already."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if (
            self.save_last
            and self._is_last_step(trainer)
            and self._last_global_step_saved != trainer.global_step
        ):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing: checkpoints are taken at the end of training steps."""

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing: checkpoints are taken at the end of training steps."""

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing: the last step already saved ``last.ckpt``."""
