"""A tiny MLM LightningModule, a validation set and the one-pass reference for perplexity tests.

Module-level so that spawned processes (tests.dist_utils.run_distributed) can import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.lightning import ValidationPerplexityCallback
from bert_reduce.reports import reduce_reports
from tests.helpers import exact_training
from tests.helpers.exact_training import MLMSamples
from tests.helpers.reference import reference_loss

# The validation set: 11 samples in batches of 4 (3 + ... per rank), a size that divides neither
# the batch size nor the number of ranks; uneven masked counts per batch, and samples with none.
SIZE, BATCH = 11, 4


class TinyMLM(pl.LightningModule):
    """exact_training's fp64 ``TinyMLM``, ``token_logits`` in ``[s, b, v]`` as Megatron's.

    ``validation_step`` returns the loss report (the callback's contract) and, to compare with
    NeMo 2, logs ``nemo_val_loss`` the way NeMo's ``MegatronStrategy.validation_step`` logs
    ``val_loss`` (``self.lightning_module.log("val_loss", out, prog_bar=True, on_epoch=True)``
    with ``out`` the step's reduced mean loss, and no batch size Lightning could read from its
    dataloader iterator): each step's mean, averaged over steps with equal weights.
    """

    def __init__(self, lr: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = exact_training.TinyMLM().double()
        self.lr = lr

    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.model(batch)

    def _loss(self, batch: Mapping[str, Tensor], validation: bool) -> tuple[Tensor, Any]:
        loss_fn = BERTMLMLossWithReduction(validation_step=validation, send_val_output=False)
        loss_fn.setup(batch)
        loss_sum, num_tokens, report = loss_fn(self(batch))
        return loss_sum / num_tokens.clamp(min=1), report

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch, validation=False)[0]

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        _, report = self._loss(batch, validation=True)
        if self.trainer.world_size == 1:
            step_mean = reduce_reports([report])
            self.log("nemo_val_loss", step_mean, batch_size=1, on_step=False, on_epoch=True)
        return dict(report)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def reference(model: TinyMLM, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, int]:
    """``(mean NLL, perplexity, masked tokens)`` of ``MLMSamples`` rows in one pass, fp64.

    The mean is ``F.cross_entropy`` over every masked token, weighted by a float ``loss_mask``
    (``TokenPerplexity`` against ``torchmetrics``' perplexity: tests/test_metrics.py).
    """
    with torch.no_grad():
        logits_sbv = model(batch)["token_logits"]
    loss = reference_loss(logits_sbv, batch["labels"], batch["loss_mask"], "per_token")
    return loss, loss.exp(), int(batch["loss_mask"].sum())


def assert_matches_reference(
    callback: ValidationPerplexityCallback, model: TinyMLM, data: MLMSamples
) -> None:
    """The callback's last result is the one-pass reference's: denominator (the sum of the
    weights), loss and perplexity."""
    ref_loss, ref_ppl, _ = reference(model, data[:])
    result = callback.result
    assert result is not None
    denominator = data.loss_mask.sum().to(torch.float64)
    torch.testing.assert_close(result.denominator, denominator, rtol=1e-15, atol=0)
    torch.testing.assert_close(result.loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(result.perplexity, ref_ppl, rtol=1e-12, atol=0)
