"""The Hydra configuration: composition, typed overrides, clear errors, instantiation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import TQDMProgressBar
from omegaconf import DictConfig

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.lightning import (
    RNGStateCheckpoint,
    RunCheckpoint,
    StopOnSignal,
    ValidationPerplexityCallback,
)
from bert_reduce.normalization import Normalization
from bert_reduce.recipe.build import build_module, build_trainer, resolve_precision
from bert_reduce.recipe.checkpoint_io import AtomicCheckpointIO
from bert_reduce.recipe.config import NormalizationName, register_configs
from bert_reduce.recipe.csv_logger import AppendingCSVLogger
from bert_reduce.recipe.datamodule import ESMDataModule
from bert_reduce.recipe.model import ESM2Model

CONF = str(Path(__file__).resolve().parents[2] / "conf")

register_configs()


def make(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_defaults_compose() -> None:
    cfg = make()
    assert cfg.model.hidden_size == 64 and cfg.trainer.devices == 1
    assert cfg.loss.normalization is NormalizationName.per_token
    assert cfg.optim.scheduler.total_steps == cfg.trainer.max_steps
    assert cfg.data.seed == cfg.seed
    assert cfg.trainer.use_distributed_sampler is False


def test_issue_overrides() -> None:
    cfg = make(
        "trainer.devices=2",
        "data.micro_batch_size=4",
        "data.global_batch_size=16",
        "loss.normalization=per_sequence",
        "trainer.max_steps=50",
        "model=esm2_8m",
    )
    assert (cfg.trainer.devices, cfg.data.micro_batch_size, cfg.data.global_batch_size) == (
        2,
        4,
        16,
    )
    assert cfg.loss.normalization is NormalizationName.per_sequence
    assert cfg.optim.scheduler.total_steps == 50
    assert cfg.model.hidden_size == 320


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ("trainer.max_steps=abc", ConfigCompositionException, "trainer.max_steps=abc"),
        ("trainer.max_step=3", ConfigCompositionException, "Could not override 'trainer.max_step'"),
        ("loss.normalization=mean", ConfigCompositionException, "loss.normalization=mean"),
        ("model.dropout=high", ConfigCompositionException, "model.dropout=high"),
        ("model=huge", MissingConfigException, "Could not find 'model/huge'"),
    ],
)
def test_bad_overrides_fail_at_composition(
    override: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        make(override)
    if error is ConfigCompositionException and "=" in message and "Could not" not in message:
        # Hydra chains the type error that names the expected type.
        assert "could not be converted" in str(info.value.__cause__) or "Invalid value" in str(
            info.value.__cause__
        )


def test_instantiate_every_part(tmp_path: Path) -> None:
    cfg = make(
        "loss.normalization=constant",
        "loss.constant_per_sequence=40",
        "data.num_train_sequences=40",
        "data.num_val_sequences=7",
    )
    model = instantiate(cfg.model)
    assert isinstance(model, ESM2Model) and len(model.layers) == cfg.model.num_layers
    datamodule = instantiate(cfg.data)
    assert isinstance(datamodule, ESMDataModule)
    datamodule.setup("fit")
    assert len(datamodule.train_dataset) == 40 and len(datamodule.val_dataset) == 7

    module = build_module(cfg)
    assert isinstance(module.loss_fn, BERTMLMLossWithReduction)
    assert module.loss_fn.normalization is Normalization.CONSTANT
    assert module.loss_fn.constant_per_sequence == 40
    assert module.micro_batch_size == cfg.data.micro_batch_size
    optimizer = module.optimizer_factory(module.parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["lr"] == cfg.optim.optimizer.lr
    assert optimizer.defaults["betas"] == (0.9, 0.98)
    scheduler = module.lr_scheduler_factory(optimizer)
    assert scheduler.get_last_lr()[0] < cfg.optim.optimizer.lr  # warming up

    trainer = build_trainer(cfg, tmp_path)
    kinds = {type(c) for c in trainer.callbacks}
    assert {RunCheckpoint, ValidationPerplexityCallback, TQDMProgressBar} <= kinds
    assert {StopOnSignal, RNGStateCheckpoint} <= kinds
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert isinstance(trainer.loggers[0], AppendingCSVLogger)
    assert Path(trainer.loggers[0].log_dir) == tmp_path
    assert trainer.max_steps == cfg.trainer.max_steps
    assert trainer.precision == resolve_precision("auto")


def test_null_drops_callback_and_scheduler(tmp_path: Path) -> None:
    cfg = make("callbacks.val_perplexity=null", "optim.scheduler=null", "tensorboard=false")
    trainer = build_trainer(cfg, tmp_path)
    assert not any(isinstance(c, ValidationPerplexityCallback) for c in trainer.callbacks)
    assert build_module(cfg).lr_scheduler_factory is None


def test_precision_auto() -> None:
    assert resolve_precision("bf16-mixed") == "bf16-mixed"
    expected = (
        "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"
    )
    assert resolve_precision("auto") == expected
