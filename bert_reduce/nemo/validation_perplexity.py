"""Exact ``val_loss`` / ``val_ppl`` under NeMo 2, from the reports NeMo hands its callbacks.

NeMo 2 logs ``val_loss`` as a mean over validation steps of each step's reduced loss.
:class:`NeMoValidationPerplexityCallback` reads the per-micro-batch reports NeMo hands its
``MegatronParallel`` callbacks (``on_megatron_reduce_microbatches_end``), adds up their
``(loss_sum, denominator)``, syncs the two sums once at the end of the epoch and logs
``loss_sum / denominator`` and its ``exp``: the loss and perplexity over every masked token of
the validation set, with :class:`bert_reduce.nemo.ExactValidationDataSampler` feeding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from bert_reduce.lightning.validation_perplexity import ValidationPerplexityCallback

__all__ = ["NeMoValidationPerplexityCallback"]


class NeMoValidationPerplexityCallback(ValidationPerplexityCallback):
    """:class:`~bert_reduce.lightning.ValidationPerplexityCallback` fed by NeMo 2's reports.

    Add it to ``nl.Trainer(callbacks=[...])``: NeMo's ``MegatronStrategy`` registers trainer
    callbacks with ``MegatronParallel``, which calls ``on_megatron_reduce_microbatches_end``
    with every micro-batch report of a step (on the last pipeline stage). NeMo's own
    ``validation_step`` output, a reduced scalar, is ignored. ``val_loss`` / ``val_ppl`` (the
    keys can be changed) are logged at the end of each validation epoch, the same value on
    every data-parallel rank; NeMo logs its own mean of step means under ``val_loss`` from
    ``validation_step``, and the callback's epoch-end value replaces it in
    ``trainer.callback_metrics`` and loggers. Pipeline parallelism is not supported: the
    other stages hold no reports. Arguments as the Lightning callback's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._collecting = False

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_epoch_start(trainer, pl_module)
        self._collecting = not trainer.sanity_checking

    def on_megatron_reduce_microbatches_end(self, microbatch_outputs: Sequence[Any]) -> None:
        """NeMo's ``MegatronParallel`` hook: the reports of every micro-batch of a step."""
        if self._collecting:
            self.metric.update_from_reports(list(microbatch_outputs))

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """NeMo hands the step's reduced scalar here; the reports came through the hook."""

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collecting = False
        super().on_validation_epoch_end(trainer, pl_module)
