"""A tiny MLM LightningModule, a validation set and the one-pass reference for perplexity tests.

Module-level so that spawned processes (tests.dist_utils.run_distributed) can import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.lightning import ValidationPerplexityCallback
from bert_reduce.reports import reduce_reports
from tests.helpers.mode_reference import reference_mode_loss

SEQ_LEN, VOCAB, HIDDEN = 8, 11, 6
# Masking probability per sample: uneven masked counts per batch, and samples with none.
MASK_PROBS = (0.5, 0.1, 0.0, 0.9, 0.3, 0.7, 0.0, 0.2, 0.6, 0.4, 0.8, 0.15, 0.05)
# The validation set: 11 samples in batches of 4 (3 + ... per rank), a size that divides neither
# the batch size nor the number of ranks.
SIZE, BATCH = 11, 4


class MLMSamples(Dataset[dict[str, Tensor]]):
    """``size`` samples of ``input_ids``, ``labels`` (-100 where unscored), ``loss_mask``."""

    def __init__(self, size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=gen)
        probs = torch.tensor([MASK_PROBS[i % len(MASK_PROBS)] for i in range(size)])
        self.loss_mask = torch.rand(size, SEQ_LEN, generator=gen) < probs[:, None]
        targets = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=gen)
        self.labels = torch.where(self.loss_mask, targets, -100)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "loss_mask": self.loss_mask[index],
        }


class TinyMLM(pl.LightningModule):
    """Embedding + linear head in fp64, ``token_logits`` in ``[s, b, v]`` as Megatron's.

    ``validation_step`` returns the loss report (the callback's contract) and, to compare with
    NeMo 2, logs ``nemo_val_loss`` the way NeMo's ``MegatronStrategy.validation_step`` logs
    ``val_loss`` (``self.lightning_module.log("val_loss", out, prog_bar=True, on_epoch=True)``
    with ``out`` the step's reduced mean loss, and no batch size Lightning could read from its
    dataloader iterator): each step's mean, averaged over steps with equal weights.
    """

    def __init__(self, lr: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.head = nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)
        self.lr = lr

    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        hidden = self.embed(batch["input_ids"].transpose(0, 1))
        return {"token_logits": self.head(torch.tanh(hidden))}

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


def reference(model: TinyMLM, dataset: MLMSamples) -> tuple[Tensor, Tensor, int]:
    """``(mean NLL, perplexity, masked tokens)`` of the whole set in one pass, fp64.

    The mean is ``F.cross_entropy`` over every masked token, weighted by a float ``loss_mask``
    (``TokenPerplexity`` against ``torchmetrics``' perplexity: tests/test_metrics.py).
    """
    with torch.no_grad():
        logits_sbv = model({"input_ids": dataset.input_ids})["token_logits"]
    loss = reference_mode_loss(logits_sbv, dataset.labels, dataset.loss_mask, "per_token")
    return loss, loss.exp(), int(dataset.loss_mask.sum())


def assert_matches_reference(
    callback: ValidationPerplexityCallback, model: TinyMLM, data: MLMSamples
) -> None:
    """The callback's last result is the one-pass reference's: denominator (the sum of the
    weights), loss and perplexity."""
    ref_loss, ref_ppl, _ = reference(model, data)
    result = callback.result
    assert result is not None
    denominator = data.loss_mask.sum().to(torch.float64)
    torch.testing.assert_close(result.denominator, denominator, rtol=1e-15, atol=0)
    torch.testing.assert_close(result.loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(result.perplexity, ref_ppl, rtol=1e-12, atol=0)


def loader(dataset: MLMSamples, batch_size: int, **kwargs: Any) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, **kwargs)
