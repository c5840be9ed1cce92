"""The recipe's LightningModule: :class:`ExactMLMModule` driving an :class:`ESM2Model`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from typing_extensions import override

from bert_reduce.lightning import ExactMLMModule


class ESM2MLMModule(ExactMLMModule):
    """Exact global-batch MLM training of a model called as ``model(input_ids, attention_mask)``.

    Everything but the call is :class:`bert_reduce.lightning.ExactMLMModule`'s (same
    arguments). On top of it, ``lr`` is logged with each ``train_loss``, ``step`` as the
    optimizer steps done when a row is logged (docs/recipe.md, "The run directory"), and the
    step of the last validation epoch kept in ``last_validation_step`` (the entry point then
    does not validate the same weights twice).
    """

    last_validation_step: int | None = None

    @override
    def forward(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """:meth:`ESM2Model.forward <bert_reduce.recipe.model.ESM2Model.forward>` of a micro-batch.

        Padded: ``input_ids`` and ``attention_mask`` of shape ``[b, s]``. Packed: one
        ``[1, T]`` row of ``input_ids`` with ``cu_seqlens`` (and ``cu_seqlens_padded``).
        """
        return self.model(
            batch["input_ids"],
            batch.get("attention_mask"),
            cu_seqlens=batch.get("cu_seqlens"),
            cu_seqlens_padded=batch.get("cu_seqlens_padded"),
        )

    @override
    def micro_batches(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Packed micro-batches as the data pipeline made them, else ``[b, s]`` splits.

        Packed ones come in ``batch["micro_batches"]``, from
        :class:`~bert_reduce.recipe.data.PackedMicroBatchCollator`.
        """
        if "micro_batches" in batch:
            return list(batch["micro_batches"])
        return super().micro_batches(batch)

    @override
    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        """:meth:`ExactMLMModule.training_step`, logging ``lr`` and ``step``."""
        lr = self.optimizers().param_groups[0]["lr"]
        loss = super().training_step(batch, batch_idx)
        # Lightning writes a logged "step" as the row's step. Its own counter lags by one in
        # validation during fit, and not in a standalone validate.
        step = float(self.trainer.global_step)
        self.log_dict({"lr": lr, "step": step}, on_step=True, on_epoch=False, batch_size=1)
        return loss

    @override
    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.last_validation_step = self.trainer.global_step
            self.log("step", float(self.trainer.global_step), on_epoch=True, batch_size=1)
