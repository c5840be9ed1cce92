"""From a composed config to a finished run: what ``train.py`` does, importable for tests.

Every object comes from ``hydra.utils.instantiate`` on its config node; this module only
wires them together, picks the precision, adds the loggers and writes the run's outputs.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger, Logger
from omegaconf import DictConfig, OmegaConf

from bert_reduce.recipe.datamodule import ESMDataModule
from bert_reduce.recipe.module import ESM2MLMModule
from bert_reduce.recipe.plot import plot_metrics

__all__ = [
    "build_callbacks",
    "build_loggers",
    "build_module",
    "build_trainer",
    "resolve_precision",
    "run",
]

log = logging.getLogger(__name__)


def resolve_precision(precision: str) -> str:
    """``"auto"``: ``"bf16-mixed"`` on a CUDA GPU that supports bf16, else ``"32-true"``."""
    if precision != "auto":
        return precision
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def build_module(cfg: DictConfig) -> ESM2MLMModule:
    """The model, training loss, optimizer and schedule of ``cfg``, in an ESM2MLMModule."""
    loss_cfg = OmegaConf.to_container(cfg.loss, resolve=True)
    # The loss takes the normalization's name; the config holds it as a typed enum.
    loss_cfg["normalization"] = cfg.loss.normalization.value  # type: ignore[index]
    return ESM2MLMModule(
        model=instantiate(cfg.model),
        micro_batch_size=cfg.data.micro_batch_size,
        optimizer=instantiate(cfg.optim.optimizer),
        lr_scheduler=None if cfg.optim.scheduler is None else instantiate(cfg.optim.scheduler),
        loss_fn=instantiate(loss_cfg),
        gradient_clip_val=cfg.optim.gradient_clip_val,
    )


def build_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """One callback per non-null entry of ``cfg.callbacks``.

    The progress bar is left out when ``trainer.enable_progress_bar`` is false (Lightning
    refuses a progress-bar callback then).
    """
    nodes = dict(cfg.callbacks)
    if not cfg.trainer.enable_progress_bar:
        nodes.pop("progress_bar", None)
    return [instantiate(node) for node in nodes.values() if node is not None]


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    """``run_dir/metrics.csv``, and TensorBoard under ``run_dir/tensorboard`` if installed."""
    loggers: list[Logger] = [CSVLogger(save_dir=run_dir, name="", version="")]
    if cfg.tensorboard:
        try:
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(save_dir=run_dir, name="tensorboard", version=""))
        except ModuleNotFoundError:
            log.info("TensorBoard is not installed: logging to metrics.csv only.")
    return loggers


def build_trainer(cfg: DictConfig, run_dir: Path) -> pl.Trainer:
    """The Trainer of ``cfg.trainer`` with the callbacks, loggers and resolved precision."""
    return instantiate(
        cfg.trainer,
        precision=resolve_precision(cfg.trainer.precision),
        callbacks=build_callbacks(cfg),
        logger=build_loggers(cfg, run_dir),
        default_root_dir=str(run_dir),
    )


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train, validate at the end, and write the run's outputs to ``run_dir``.

    Outputs: ``metrics.csv`` (``step``, ``train_loss``, ``val_loss``, ``val_ppl``, ...),
    ``checkpoints/``, ``config.yaml`` (resolved) and ``curves.png``.

    Args:
        cfg: A config composed from ``conf/config.yaml``.
        run_dir: The run directory (Hydra's output directory under ``train.py``).

    Returns:
        The trainer's final logged metrics as floats (``val_loss``, ``val_ppl``, ...).
    """
    run_dir = Path(run_dir)
    if cfg.cpu_threads is not None and not torch.cuda.is_available():
        # The environment variable reaches DDP's worker processes, and Lightning keeps it.
        os.environ["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
        torch.set_num_threads(cfg.cpu_threads)
    # ExactMLMModule steps the optimizer inside training_step, so a checkpoint holds the state
    # after the step: what resuming needs (tests/recipe/test_train_e2e.py checks it).
    warnings.filterwarnings(
        "ignore", message="Using ModelCheckpoint with manual optimization and every_n_train_steps"
    )
    # The run directory always holds Hydra's files already; the CSV logger only writes its
    # metrics.csv there, so its "directory exists and is not empty" warning would always fire.
    warnings.filterwarnings(
        "ignore", message="Experiment logs directory .* exists and is not empty"
    )
    pl.seed_everything(cfg.seed, workers=True)
    datamodule: ESMDataModule = instantiate(cfg.data)
    module = build_module(cfg)
    trainer = build_trainer(cfg, run_dir)
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume)
    if cfg.validate_at_end and module.last_validation_step != trainer.global_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.save()
        outputs = ["metrics.csv", "config.yaml", "checkpoints/"]
        if cfg.plot:
            plot_metrics(run_dir / "metrics.csv", run_dir / "curves.png")
            outputs.append("curves.png")
        summary = ", ".join(
            f"{key}={metrics[key]:.4f}"
            for key in ("train_loss", "val_loss", "val_ppl")
            if key in metrics
        )
        print(f"Finished {trainer.global_step} steps: {summary}")
        cwd = Path.cwd()
        shown = run_dir.relative_to(cwd) if run_dir.is_relative_to(cwd) else run_dir
        print(f"Run directory {shown}: {', '.join(outputs)}")
    return metrics
