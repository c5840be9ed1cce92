"""The Hydra configuration: composition, typed overrides, clear errors, instantiation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from lightning.pytorch.callbacks import TQDMProgressBar
from omegaconf import OmegaConf

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.lightning import ValidationPerplexityCallback
from bert_reduce.normalization import Normalization
from bert_reduce.recipe.build import (
    build_from_config,
    build_module,
    build_trainer,
    resolve_precision,
)
from bert_reduce.recipe.callbacks import RunCheckpoint, StopOnSignal
from bert_reduce.recipe.config import (
    DataConfig,
    ModelConfig,
    NormalizationName,
)
from bert_reduce.recipe.csv_logger import AppendingCSVLogger
from bert_reduce.recipe.datamodule import ESMDataModule
from bert_reduce.recipe.files import AtomicCheckpointIO
from bert_reduce.recipe.model import ESM2Model
from tests.helpers.recipe_runs import compose_config as make


def test_defaults_and_the_documented_overrides_compose() -> None:
    cfg = make()
    # ESM2Model() and ESMDataModule() build what `python train.py` builds.
    assert OmegaConf.to_object(cfg.model) == ModelConfig()
    assert OmegaConf.to_object(cfg.data) == DataConfig()
    assert cfg.model.hidden_size == 64 and cfg.trainer.devices == 1
    assert cfg.loss.normalization is NormalizationName.per_token
    assert cfg.optim.scheduler.total_steps == cfg.trainer.max_steps
    assert make("seed=3").data.seed == 3  # the data's seed is the run's
    assert cfg.trainer.use_distributed_sampler is False
    # docs/recipe.md, "Overrides"
    cfg = make(
        "trainer.devices=2",
        "data.micro_batch_size=4",
        "data.global_batch_size=16",
        "loss.normalization=per_sequence",
        "trainer.max_steps=50",
        "model=esm2_8m",
    )
    assert cfg.trainer.devices == 2 and cfg.data.micro_batch_size == 4
    assert cfg.data.global_batch_size == 16
    assert cfg.loss.normalization is NormalizationName.per_sequence
    assert cfg.optim.scheduler.total_steps == 50
    assert cfg.model.hidden_size == 320


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ("trainer.max_steps=abc", ConfigCompositionException, "trainer.max_steps=abc"),
        ("trainer.max_step=3", ConfigCompositionException, "Could not override 'trainer.max_step'"),
        ("model.dropout=high", ConfigCompositionException, "model.dropout=high"),
        ("model=huge", MissingConfigException, "Could not find 'model/huge'"),
    ],
)
def test_bad_overrides_fail_at_composition(
    override: str, error: type[Exception], message: str
) -> None:
    # The enum's own message: test_normalization_names_are_the_modes.
    with pytest.raises(error, match=message):
        make(override)


def test_instantiate_every_part(tmp_path: Path) -> None:
    cfg = make(
        "loss.normalization=constant",
        "loss.constant_per_sequence=40",
        "data.num_train_sequences=40",
        "data.num_val_sequences=7",
    )
    model = build_from_config(cfg.model)
    assert isinstance(model, ESM2Model) and len(model.layers) == cfg.model.num_layers
    datamodule = build_from_config(cfg.data)
    assert isinstance(datamodule, ESMDataModule)
    datamodule.setup("fit")
    assert len(datamodule.train_dataset) == 40 and len(datamodule.val_dataset) == 7

    module = build_module(cfg)
    assert isinstance(module.loss_fn, BERTMLMLossWithReduction)
    assert module.loss_fn.options.normalization is Normalization.CONSTANT
    assert module.loss_fn.options.constant_per_sequence == 40
    assert module.micro_batch_size == cfg.data.micro_batch_size
    optimizer = module.optimizer_factory(module.parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["lr"] == cfg.optim.optimizer.lr
    assert optimizer.defaults["betas"] == (0.9, 0.98)
    scheduler = module.lr_scheduler_factory(optimizer)
    assert scheduler.get_last_lr()[0] < cfg.optim.optimizer.lr  # warming up

    trainer = build_trainer(cfg, tmp_path)
    kinds = {type(c) for c in trainer.callbacks}
    assert {RunCheckpoint, StopOnSignal, ValidationPerplexityCallback, TQDMProgressBar} <= kinds
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


def test_normalization_names_are_the_modes() -> None:
    # One list of modes (bert_reduce.normalization); the config's enum is named by their values,
    # which is what the command line and config.yaml write.
    assert [(m.name, m.value) for m in NormalizationName] == [
        (m.value, m.value) for m in Normalization
    ]
    for name in NormalizationName:
        assert Normalization(name) is Normalization(name.value)
    cfg = make("loss.normalization=per_sequence")
    assert "normalization: per_sequence" in OmegaConf.to_yaml(cfg.loss)
    with pytest.raises(ConfigCompositionException) as info:
        make("loss.normalization=PER_SEQUENCE")
    assert "expected one of [per_token, per_sequence, constant]" in str(info.value.__cause__)
