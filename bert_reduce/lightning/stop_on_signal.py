"""Preemption: on ``SIGTERM`` or ``SIGINT``, finish the current step, checkpoint it, and stop.

Lightning's own ``SIGTERM`` handler (``lightning/pytorch/trainer/connectors/
signal_connector.py``) marks ``trainer.received_sigterm`` the moment the signal arrives; the
loops then raise ``SIGTERMException`` at the next place that checks it, which may be the middle
of a validation epoch (``loops/evaluation_loop.py``) where no checkpoint is taken: the steps
since the last periodic checkpoint are lost. Under Lightning 2.6 that handler also runs a
collective, from inside the signal handler, on the one rank that received the signal.
``SIGINT`` raises ``KeyboardInterrupt`` anywhere, and ``Ctrl+C`` ends the run with no checkpoint
either.

:class:`StopOnSignal` replaces both handlers during training with one that only records the
signal. At the end of each training step the ranks agree on whether any of them received one
(one all-reduce of a flag, only with several ranks). If so, :attr:`stop_signal` is set: the
checkpoint callback (:class:`~bert_reduce.lightning.RunCheckpoint`) saves ``last.ckpt`` for
this step, Lightning logs the step (and validates, if due), and at the start of the next step
this callback raises Lightning's public ``SIGTERMException``, before any of that step's work.
A second ``SIGINT`` stops at once, as ``Ctrl+C`` always does. Lightning puts the previous
handlers back when ``fit`` ends.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

__all__ = ["StopOnSignal"]

log = logging.getLogger(__name__)


class StopOnSignal(Callback):
    """Stop training at the next step boundary after ``SIGTERM``/``SIGINT``, with a checkpoint.

    After ``fit`` returns or raises ``SIGTERMException``, :attr:`stop_signal` is the signal that
    stopped training (``None`` if none did): the entry point exits with ``128 + stop_signal``,
    the shell's convention for a process ended by a signal.

    Args:
        signals: The signals that request a stop.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.received: int | None = None
        self.stop_signal: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: stop now, without a checkpoint
        self.received = signum
        log.warning(
            "Received %s: stopping after the current training step with a checkpoint "
            "(press Ctrl+C again to stop at once, without one).",
            signal.Signals(signum).name,
        )

    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                signal.signal(signum, self._handle)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received = self.stop_signal = None

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Agree across ranks whether to stop after this step; set :attr:`stop_signal` if so."""
        stop = self.received is not None
        if trainer.world_size > 1:
            # Every rank must stop after the same step: a signal sent to one process only
            # (the launcher, say) reaches the others through this flag.
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            self.stop_signal = self.received if self.received is not None else signal.SIGTERM

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Stop before the step after the one that agreed to stop.

        Raises:
            SIGTERMException: If :attr:`stop_signal` is set. The previous step's rows are
                logged and its validation (if due) is done by now, so the checkpoint callback
                can complete that step's checkpoint (Lightning calls ``on_exception``).
        """
        if self.stop_signal is not None:
            raise SIGTERMException(128 + self.stop_signal)
