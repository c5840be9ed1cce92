"""Exact validation loss and perplexity over a whole validation epoch, as a Lightning callback.

Its contract and what it guarantees: ``docs/perplexity.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from bert_reduce.functional import safe_divide
from bert_reduce.lightning._lightning_private import (
    callback_state_key,
    restart_validation_from_its_start,
)
from bert_reduce.metrics import TokenPerplexity, perplexity_from_sums
from bert_reduce.sampling import check_no_repeated_samples


class ValidationResult(NamedTuple):
    """The reduced totals of one validation epoch, identical on every rank.

    Attributes:
        loss_sum: 0-dim fp64 sum of the NLL of every masked token of the validation set.
        denominator: 0-dim fp64 number of masked tokens (sum of the weights for a weighted
            mask; :func:`bert_reduce.functional.token_denominator`).
        loss: 0-dim fp64 ``loss_sum / denominator`` (0.0 when there is no masked token).
        perplexity: 0-dim fp64 ``exp(loss)`` (1.0 when there is no masked token).
    """

    loss_sum: Tensor
    denominator: Tensor
    loss: Tensor
    perplexity: Tensor


class ValidationPerplexityCallback(Callback):
    """Logs the token-weighted validation loss and perplexity of each validation epoch.

    ``validation_step`` returns the loss report (:mod:`bert_reduce.reports`) or a list of them;
    the last :class:`ValidationResult` is in :attr:`result` and in checkpoints. The contract,
    samplers and resume: ``docs/perplexity.md``.

    Args:
        loss_key: Name the token-weighted mean validation loss is logged under.
        ppl_key: Name the validation perplexity is logged under.
        prog_bar: Also show both values in the progress bar.
        check_sampler: At the start of each validation epoch, run
            :func:`bert_reduce.sampling.check_no_repeated_samples` on the validation loaders.
        process_group: Group the sums are reduced over; see :class:`bert_reduce.TokenPerplexity`.
    """

    def __init__(
        self,
        loss_key: str = "val_loss",
        ppl_key: str = "val_ppl",
        *,
        prog_bar: bool = True,
        check_sampler: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.loss_key = loss_key
        self.ppl_key = ppl_key
        self.prog_bar = prog_bar
        self.check_sampler = check_sampler
        self.metric = TokenPerplexity(process_group=process_group)
        self.result: ValidationResult | None = None

    @property
    @override
    def state_key(self) -> str:
        return callback_state_key(self, loss_key=self.loss_key, ppl_key=self.ppl_key)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restart_validation_from_its_start(trainer)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self.check_sampler:
            check_no_repeated_samples(trainer.val_dataloaders)
        # A restarted epoch starts again from its first batch: begin from zero whatever the
        # metric held when the run stopped.
        self.metric.reset()
        self.metric.to(pl_module.device)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking:
            return
        if outputs is None:
            raise ValueError(
                f"{type(self).__name__} needs validation_step to return the loss report (a "
                "mapping with 'loss_sum_and_microbatch_size', a [2] tensor (loss_sum, "
                f"denominator)) or a list of them; {type(pl_module).__name__}.validation_step "
                f"returned None for batch {batch_idx} of dataloader {dataloader_idx}."
            )
        self.metric.update_from_reports(outputs)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        loss_sum, denominator = self._epoch_totals(trainer)
        self.metric.reset()
        self.result = ValidationResult(
            loss_sum=loss_sum,
            denominator=denominator,
            loss=safe_divide(loss_sum, denominator),
            perplexity=perplexity_from_sums(loss_sum, denominator),
        )
        metrics = {self.loss_key: self.result.loss, self.ppl_key: self.result.perplexity}
        pl_module.log_dict(metrics, prog_bar=self.prog_bar, on_step=False, on_epoch=True)

    def _epoch_totals(self, trainer: pl.Trainer) -> tuple[Tensor, Tensor]:
        """This epoch's ``(loss_sum, denominator)`` summed over ranks: the one sync."""
        with self.metric.sync_context():
            return self.metric.loss_sum.clone(), self.metric.denominator.clone()

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.result is None:
            return {"result": None}
        return {"result": {name: value.cpu() for name, value in self.result._asdict().items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "result" not in state_dict:
            raise KeyError(
                f"{type(self).__name__} state has no 'result' key; it has {sorted(state_dict)}."
            )
        saved = state_dict["result"]
        self.result = None if saved is None else ValidationResult(**saved)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(loss_key={self.loss_key!r}, ppl_key={self.ppl_key!r}, "
            f"check_sampler={self.check_sampler})"
        )
