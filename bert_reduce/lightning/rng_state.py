"""Every rank's random-number generators in the checkpoint, for bit-exact resume with dropout.

Dropout draws from the process' global torch generator (and the CUDA one on a GPU), so a run
resumed from a checkpoint trains with other dropout masks than the uninterrupted run unless
that state travels with the weights. :class:`RNGStateCheckpoint` gathers the Python, NumPy,
torch and CUDA generator states of every rank into the checkpoint and, after a resume, puts
rank ``r``'s states back right before the first training step, so that whatever ran in
between (sanity validation, building the data iterator) does not shift them.

The checkpoint is taken at the end of a training step, and the states are restored at the
start of the next one. In between, an uninterrupted run must not draw from the global
generators: validation runs with dropout off, and loaders that draw their worker seeds should
have their own ``generator`` (the recipe's do).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["RNGStateCheckpoint", "get_rng_states", "set_rng_states"]

log = logging.getLogger(__name__)


def get_rng_states() -> dict[str, Any]:
    """This process' generator states, in types a ``weights_only`` checkpoint load accepts.

    Returns:
        ``python`` (``random.getstate()``), ``numpy`` (the legacy global generator: key as
        an int64 tensor, position, gauss flag and cached value), ``torch`` (CPU) and ``cuda``
        (one state per device, or ``None`` when CUDA is not initialized).
    """
    _, key, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (torch.from_numpy(key.astype(np.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_states` returned."""
    random.setstate(states["python"])
    key, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state(
        ("MT19937", key.numpy().astype(np.uint32), position, has_gauss, cached_gaussian)
    )
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RNGStateCheckpoint(Callback):
    """Saves every rank's generator states in checkpoints and restores them on resume.

    Stored under ``checkpoint["callbacks"]["RNGStateCheckpoint"]["ranks"]``, one entry per
    rank (an ``all_gather_object`` when a process group exists: every rank takes part in
    saving a checkpoint). A run resumed on another number of ranks cannot draw the masks of
    the uninterrupted run (each rank draws its own); it then restores the states of the ranks
    it has, and logs a warning.
    """

    def __init__(self) -> None:
        self._to_restore: list[dict[str, Any]] | None = None

    @override
    def state_dict(self) -> dict[str, Any]:
        states = get_rng_states()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, states)
            return {"ranks": gathered}
        return {"ranks": [states]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict["ranks"]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._to_restore is None:
            return
        ranks, self._to_restore = self._to_restore, None
        if len(ranks) != trainer.world_size:
            log.warning(
                "The checkpoint holds the random states of %d rank(s), this run has %d: "
                "dropout masks after the resume differ from those of the uninterrupted run.",
                len(ranks),
                trainer.world_size,
            )
        set_rng_states(ranks[trainer.global_rank % len(ranks)])
