"""The recipe's fault tolerance: stop at a step boundary, checkpoint once the step is logged.

What it guarantees (every logged row exactly once, bit-exact with dropout): docs/recipe.md,
"Preemptible clusters".
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import threading
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from bert_reduce.recipe.files import put_in_place, temporary_name, write_atomically

__all__ = ["LAST_NAME", "RunCheckpoint", "StopOnSignal"]

log = logging.getLogger(__name__)

LAST_NAME = "last.ckpt"
"""The checkpoint of the latest step of the run."""


class StopOnSignal(Callback):
    """Stop training at the next step boundary after ``SIGTERM``/``SIGINT``, with a checkpoint.

    Lightning's own ``SIGTERM`` handler stops wherever its loops next check, possibly
    mid-validation where no checkpoint is taken (under Lightning 2.6 it also runs a collective
    inside the handler), and ``SIGINT`` raises ``KeyboardInterrupt`` anywhere. This one only
    records the signal; the next step's start raises Lightning's ``SIGTERMException(128 +
    stop_signal)`` (docs/recipe.md, "Preemption: SIGTERM and Ctrl+C").
    """

    received: int | None = None
    stop_signal: int | None = None
    """The signal that stopped training (``None`` if none did)."""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: stop now, without a checkpoint
        self.received = signum
        log.warning(
            "Received %s: stopping after the current training step with a checkpoint "
            "(press Ctrl+C again to stop at once, without one).",
            signal.Signals(signum).name,
        )

    def _install(self, *args: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._handle)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received = self.stop_signal = None

    # Once Lightning installed its own handlers: at the sanity check, if any, and training.
    on_sanity_check_start = on_train_start = _install

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:
            # Every rank stops after the same step: a signal sent to one process only (the
            # launcher, say) reaches the others through this flag.
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            self.stop_signal = self.received or signal.SIGTERM

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.stop_signal is not None:
            raise SIGTERMException(128 + self.stop_signal)


def _get_rng_states() -> dict[str, Any]:
    """This process' generator states, in types a ``weights_only`` checkpoint load accepts."""
    _, key, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (torch.from_numpy(key.astype(np.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }


def _set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`_get_rng_states` returned."""
    random.setstate(states["python"])
    key, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state(
        ("MT19937", key.numpy().astype(np.uint32), position, has_gauss, cached_gaussian)
    )
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RunCheckpoint(Checkpoint):
    """Periodic and ``last.ckpt`` checkpoints at step ends, in place once the step is logged.

    Only at step ends, the one point where resume is exact (Lightning's ``ModelCheckpoint``
    also saves after validation and when training ends: a ``last.ckpt`` written at
    ``max_steps`` mid-epoch records that epoch as finished); renamed into place by
    :meth:`commit`; every rank's generator states put back right before the first resumed
    step. Why: docs/recipe.md, "Resume" and "Preemptible clusters".

    Args:
        dirpath: Where checkpoints go (``<default_root_dir>/checkpoints`` when ``None``).
        filename: Name of the periodic checkpoints, formatted with ``step`` and ``epoch``.
        every_n_train_steps: Save a periodic checkpoint every this many steps (0: never).
        keep_last: How many periodic checkpoints to keep, the newest (``None``: all).
        save_last: Also keep ``last.ckpt``: with every periodic checkpoint and at the last
            step (``max_steps``, the last batch of ``max_epochs``, or a requested stop).

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
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps
        self.keep_last = keep_last
        self.save_last = save_last
        self.periodic: list[tuple[int, str]] = []  # (step, file name), oldest first
        self._pending: list[tuple[Path, Path]] = []  # (temporary, final)
        self._last_saved_step: int | None = None
        self._rng_to_restore: list[dict[str, Any]] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every rank must name the same files: rank 0's choice.
        self.dirpath = trainer.strategy.broadcast(
            self.dirpath or Path(trainer.default_root_dir) / "checkpoints"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        ranks = [_get_rng_states()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, _get_rng_states())
        return {"periodic": [[step, name] for step, name in self.periodic], "rng": ranks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.periodic = [(int(step), str(name)) for step, name in state_dict["periodic"]]
        self._rng_to_restore = state_dict["rng"]

    @staticmethod
    def _is_last_step(trainer: pl.Trainer, batch_idx: int) -> bool:
        if trainer.should_stop or trainer.received_sigterm:
            return True
        if any(isinstance(c, StopOnSignal) and c.stop_signal for c in trainer.callbacks):
            return True
        if 0 <= trainer.max_steps <= trainer.global_step:
            return True
        max_epochs = trainer.max_epochs
        return (
            max_epochs is not None
            and 0 <= max_epochs <= trainer.current_epoch + 1
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
            # torch's gather of Python objects: Lightning's strategy.all_gather prints torch
            # 2.13's deprecation of torch.distributed.nn.functional.all_gather.
            steps: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(steps, trainer.global_step)
            if len(set(steps)) > 1:
                raise RuntimeError(
                    f"The ranks start training at different steps ({steps}, by rank): they "
                    "resumed from different checkpoints. Give every rank the same checkpoint "
                    "file (a file system that all nodes see alike)."
                )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.commit(trainer)  # the previous step's rows are logged by now
        if self._rng_to_restore is None:
            return
        ranks, self._rng_to_restore = self._rng_to_restore, None
        if len(ranks) != trainer.world_size:
            log.warning(
                "The checkpoint holds the random states of %d rank(s), this run has %d: "
                "dropout masks after the resume differ from those of the uninterrupted run.",
                len(ranks),
                trainer.world_size,
            )
        _set_rng_states(ranks[trainer.global_rank % len(ranks)])

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
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
        names = []
        if periodic:
            name = self.filename.format(step=step, epoch=trainer.current_epoch) + ".ckpt"
            self.periodic.append((step, name))  # before saving: its own state lists it
            names.append(name)
        if last:
            names.append(LAST_NAME)
        self._pending = [(temporary_name(self.dirpath / n), self.dirpath / n) for n in names]
        self._last_saved_step = step
        (first, writing), *copies = self._pending
        try:
            trainer.save_checkpoint(str(first), weights_only=False)
            for temporary, final in copies if trainer.is_global_zero else []:
                writing = final
                # A copy, not a link: a fault that damages one file leaves the other.
                with open(first, "rb") as source:
                    write_atomically(temporary, partial(shutil.copyfileobj, source))
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

        Only once their step's rows are logged: saved first (docs/recipe.md, "Exactly-once rows").
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
            for temporary, final in pending:
                put_in_place(temporary, final)
        if self.keep_last is not None and len(self.periodic) > self.keep_last:
            # Every rank keeps the same list; the strategy deletes on rank 0 only.
            old, self.periodic = self.periodic[: -self.keep_last], self.periodic[-self.keep_last :]
            for _, name in old:
                path = self.dirpath / name  # type: ignore[operator]
                if trainer.is_global_zero and path.exists():
                    trainer.strategy.remove_checkpoint(str(path))

    def _discard(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, []
        if trainer.is_global_zero:
            for temporary, _ in pending:
                temporary.unlink(missing_ok=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.commit(trainer)  # the last step's rows and validation are logged

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning and StopOnSignal raise SIGTERMException outside validation only after a
        # step's logging and validation: its rows are complete. Any other failure may have
        # cut them short.
        if isinstance(exception, SIGTERMException) and not (
            trainer.validating or trainer.sanity_checking
        ):
            self.commit(trainer)
        else:
            self._discard(trainer)
