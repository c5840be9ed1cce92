"""The one place bert_reduce reads or changes Lightning's undocumented state.

Everything else uses Lightning's public hooks; ``tests/test_private_names.py`` fails on these
names anywhere but here. Tested on Lightning 2.6 (the core environment: all three) and 2.4
(NeMo 2's pin: the callback state key, through the recipe's callbacks; docs/perplexity.md).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def callback_state_key(callback: pl.Callback, **keys: Any) -> str:
    """The key a callback's state is saved under, distinct for each value of ``keys``."""
    return callback._generate_state_key(**keys)


def training_batches_done(trainer: pl.Trainer) -> tuple[int, int]:
    """``(epoch, batches of it done)``, as the checkpoint records the training position."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return trainer.current_epoch, progress.current.processed


def restart_validation_from_its_start(trainer: pl.Trainer) -> None:
    """After a resume from the middle of a validation epoch, run that epoch whole.

    Lightning (2.5 to 2.6) runs such an epoch again from the loader's first batch but stops
    as many batches short as were done before the interruption
    (Lightning-AI/pytorch-lightning#19549); 2.4 has no ``restarted_mid_evaluation`` and
    restarts it whole.
    """
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    if getattr(val_loop, "restarted_mid_evaluation", False):
        val_loop.batch_progress.reset_on_run()
