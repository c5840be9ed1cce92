"""A tiny Lightning setup for callback unit tests: a real ``Trainer`` fit in about a second.

``TinyModule`` fits a linear regression with plain automatic optimization; ``RecordingLogger``
keeps what Lightning logs, in order, so that a test can check what was logged when.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyModule(pl.LightningModule):
    """``y = w x + b`` by SGD; counts its training steps; calls ``in_validation_step(module)``
    at the start of every validation step."""

    def __init__(self, in_validation_step: Callable[[TinyModule], None] | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.training_steps = 0
        self.in_validation_step = in_validation_step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self.training_steps += 1
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.layer(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        if self.in_validation_step is not None:
            self.in_validation_step(self)
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(inputs), targets))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tiny_loader(num_samples: int = 12) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(num_samples, 4, generator=generator)
    return DataLoader(TensorDataset(inputs, inputs.sum(1, keepdim=True)), batch_size=2)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(metric names, step)``, and each value by name."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[frozenset[str], int | None]] = []
        self.values: dict[str, list[float]] = {}

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.rows.append((frozenset(metrics), step))
        for name, value in metrics.items():
            self.values.setdefault(name, []).append(float(value))

    def count(self, metric: str) -> int:
        return sum(metric in names for names, _ in self.rows)


def quiet_trainer(callbacks: list[pl.Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    """A one-device CPU ``Trainer`` that logs, checkpoints and prints nothing unless told to."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return pl.Trainer(callbacks=callbacks, **options)


def tiny_trainer(tmp_path: Any, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A :func:`quiet_trainer` rooted at ``tmp_path`` that checkpoints, with a
    :class:`RecordingLogger`."""
    options: dict[str, Any] = {
        "default_root_dir": tmp_path,
        "logger": RecordingLogger(),
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": True,
        **kwargs,
    }
    return quiet_trainer(callbacks, **options)
