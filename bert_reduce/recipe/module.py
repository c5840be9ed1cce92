"""The recipe's LightningModule: :class:`ExactMLMModule` driving an :class:`ESM2Model`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from typing_extensions import override

from bert_reduce.lightning import ExactMLMModule

__all__ = ["ESM2MLMModule"]


class ESM2MLMModule(ExactMLMModule):
    """Exact global-batch MLM training of a model called as ``model(input_ids, attention_mask)``.

    Everything but the call is :class:`bert_reduce.lightning.ExactMLMModule`'s (same
    arguments). Also logs ``lr``, the learning rate of each step, on the row of its
    ``train_loss``, and remembers the optimizer step of the last validation epoch, so the entry
    point can validate at the end without validating the same weights twice.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_validation_step: int | None = None

    @override
    def forward(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """``{"token_logits": [s, b, v]}`` from ``input_ids`` and ``attention_mask`` ([b, s])."""
        return self.model(batch["input_ids"], batch["attention_mask"])

    @override
    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        """:meth:`ExactMLMModule.training_step`, logging the step's learning rate as ``lr``."""
        lr = self.optimizers().param_groups[0]["lr"]
        loss = super().training_step(batch, batch_idx)
        self.log("lr", lr, on_step=True, on_epoch=False, batch_size=1)
        return loss

    @override
    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.last_validation_step = self.trainer.global_step
