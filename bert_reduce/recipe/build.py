"""From a composed config to a finished run: what ``train.py`` does, importable for tests."""

from __future__ import annotations

import logging
import os
import re
import signal
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import get_class, instantiate
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from omegaconf import DictConfig, OmegaConf

from bert_reduce.recipe.callbacks import LAST_NAME, StopOnSignal
from bert_reduce.recipe.csv_logger import METRICS_FILE, AppendingCSVLogger, read_metrics
from bert_reduce.recipe.datamodule import ESMDataModule
from bert_reduce.recipe.files import AtomicCheckpointIO
from bert_reduce.recipe.module import ESM2MLMModule
from bert_reduce.recipe.plot import plot_metrics
from bert_reduce.recipe.run_directory import (
    AUTO,
    ResumePoint,
    RunDirectory,
    move_aside,
    resume_point,
)


class TrainingStopped(SystemExit):
    """A signal stopped training after a checkpoint; exits with ``128 + signal number``."""


log = logging.getLogger(__name__)


def resolve_precision(precision: str) -> str:
    """``"auto"``: ``"bf16-mixed"`` on a CUDA GPU that supports bf16, else ``"32-true"``."""
    if precision != "auto":
        return precision
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def build_from_config(node: DictConfig) -> Any:
    """The ``_target_`` class of a model or data node, given the node as its typed config.

    Args:
        node: ``cfg.model`` or ``cfg.data`` (why these two: :mod:`bert_reduce.recipe.config`).

    Returns:
        ``_target_(config)``, the config being the node's dataclass, interpolations resolved.
    """
    return get_class(node["_target_"])(OmegaConf.to_object(node))


def build_module(cfg: DictConfig) -> ESM2MLMModule:
    """The model, training loss, optimizer and schedule of ``cfg``, in an ESM2MLMModule."""
    # The loss takes the normalization's name: the config's enum is named by the values.
    loss_cfg = OmegaConf.to_container(cfg.loss, resolve=True, enum_to_str=True)
    return ESM2MLMModule(
        model=build_from_config(cfg.model),
        micro_batch_size=cfg.data.micro_batch_size,
        optimizer=instantiate(cfg.optim.optimizer),
        lr_scheduler=None if cfg.optim.scheduler is None else instantiate(cfg.optim.scheduler),
        loss_fn=instantiate(loss_cfg),
        gradient_clip_val=cfg.optim.gradient_clip_val,
    )


def ignore_warnings_wrong_for_the_recipe(cfg: DictConfig) -> None:
    """Silence what Lightning and torch print on every run that is wrong here or not actionable.

    Each filter matches one message (and its category or module), never a whole category, so
    that every other warning still shows; ``tests/recipe/test_train_e2e.py`` checks that the
    default runs print none.
    """
    # Lightning (up to 2.6.6, the newest) builds torch's deprecated LeafSpec in its
    # CombinedLoader (lightning/pytorch/utilities/_pytree.py:21), which torch 2.13 flags on
    # every fit: a matter between the two libraries that no setting here changes.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    # Under DDP Lightning suggests sync_dist=True for values logged per epoch. Those the recipe
    # logs are the same on every rank already (the validation callback syncs its sums once;
    # "step" is the trainer's global step): syncing them would only add collectives.
    node = cfg.callbacks.val_perplexity
    for key in ["step"] if node is None else ["step", node.loss_key, node.ppl_key]:
        warnings.filterwarnings(
            "ignore",
            message=re.escape(f"It is recommended to use `self.log({key!r}, ..., sync_dist=True)`"),
            category=PossibleUserWarning,
        )
    # Lightning's advertisements for its cloud services ("💡 Tip: ... litlogger"), at INFO.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith("💡 Tip:")
    )


def build_trainer(cfg: DictConfig, run_dir: Path) -> pl.Trainer:
    """``cfg.trainer``'s Trainer: callbacks, loggers, precision, atomic checkpoint writes.

    The callbacks: ``StopOnSignal``, and one per non-null entry of ``cfg.callbacks``, less the
    progress bar if ``trainer.enable_progress_bar`` is false (Lightning refuses one then). The
    loggers: an :class:`AppendingCSVLogger` to ``run_dir``, and TensorBoard's if it is installed.
    """
    nodes = {name: node for name, node in cfg.callbacks.items() if node is not None}
    if not cfg.trainer.enable_progress_bar:
        nodes.pop("progress_bar", None)
    loggers: list[Logger] = [AppendingCSVLogger(save_dir=run_dir)]
    if cfg.tensorboard:
        try:
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(save_dir=run_dir, name="tensorboard", version=""))
        except ModuleNotFoundError:
            rank_zero_info(  # once, not once per DDP process
                "TensorBoard is not installed: logging to metrics.csv only (pip install "
                "tensorboard to add it, or tensorboard=false to go without this message)."
            )
    return instantiate(
        cfg.trainer,
        precision=resolve_precision(cfg.trainer.precision),
        callbacks=[StopOnSignal(), *map(instantiate, nodes.values())],
        logger=loggers,
        default_root_dir=str(run_dir),
        plugins=[AtomicCheckpointIO()],
    )


def check_launcher(trainer: pl.Trainer) -> None:
    """Refuse a multi-node run that no launcher started: it would wait for its peers forever.

    Raises:
        RuntimeError: If ``trainer.num_nodes > 1`` and neither a cluster launcher (SLURM,
            ``torchrun``, ...) nor ``MASTER_ADDR``/``NODE_RANK`` tell this process its node.
    """
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if trainer.num_nodes <= 1 or not isinstance(environment, LightningEnvironment):
        return
    missing = [name for name in ("MASTER_ADDR", "NODE_RANK") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"trainer.num_nodes={trainer.num_nodes}, but this process was not started by a "
            f"multi-node launcher ({', '.join(missing)} not set): it would wait for the other "
            "nodes forever. Start train.py on every node with SLURM (srun), or torchrun "
            "--nnodes, or set MASTER_ADDR, MASTER_PORT, NODE_RANK (and WORLD_SIZE) on each; "
            "on one machine use trainer.num_nodes=1."
        )


def run(cfg: DictConfig, run_dir: str | Path, fixed_run_dir: bool = True) -> dict[str, Any]:
    """Train, validate at the end, and write the run's outputs to ``run_dir``.

    Before anything is written, the data, the model and the ``resume`` checkpoint are loaded
    and the run directory is checked and locked. The outputs, and what a run may do to a run
    directory: docs/recipe.md, "The run directory" and "Resume".

    Args:
        cfg: A config composed from ``conf/config.yaml``.
        run_dir: The run directory (Hydra's output directory under ``train.py``).
        fixed_run_dir: Whether the same command gives the same run directory at every start
            (``hydra.run.dir=...``), rather than one made from the time.

    Returns:
        The trainer's final logged metrics as floats (``val_loss``, ``val_ppl``, ...).

    Raises:
        TrainingStopped: After ``SIGTERM``/``SIGINT`` stopped training and a checkpoint was
            saved (``SystemExit`` with code ``128 + signal``).
        RunDirectoryError: If the run directory holds another run or is in use.
        FileNotFoundError, ValueError: For a bad ``resume`` checkpoint or bad data, or
            ``resume=auto`` without a fixed run directory.
    """
    run_dir = Path(run_dir)
    auto = cfg.resume == AUTO
    if auto and not fixed_run_dir:
        raise ValueError(
            f"resume=auto resumes the run of the run directory, but this one ({run_dir}) is "
            "made from the current time, so a restarted command gets a new, empty one. Name "
            "the run directory: hydra.run.dir=<a directory per run, e.g. runs/$SLURM_JOB_ID>."
        )
    if cfg.cpu_threads is not None and not torch.cuda.is_available():
        # The environment variable reaches DDP's worker processes, and Lightning keeps it.
        os.environ["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
        torch.set_num_threads(cfg.cpu_threads)
    ignore_warnings_wrong_for_the_recipe(cfg)
    global_batch_size = cfg.data.global_batch_size
    dirpath = OmegaConf.select(cfg, "callbacks.checkpoint.dirpath")  # None too if the node is null
    checkpoint_dir = Path(dirpath or run_dir / "checkpoints")
    # A named checkpoint is checked before anything is written; the run directory's
    # checkpoints (resume=auto's, a named one's later ones) are read once rank 0 holds it.
    point = None if auto else resume_point(cfg.resume, None, global_batch_size)
    pl.seed_everything(cfg.seed, workers=True)
    datamodule: ESMDataModule = build_from_config(cfg.data)
    module = build_module(cfg)
    trainer = build_trainer(cfg, run_dir)
    check_launcher(trainer)
    if not trainer.is_global_zero:
        # DDP's other ranks are processes this run started (multi-node ones are not global
        # rank 0 either): the first process alone locks and checks the run directory. With
        # resume=auto they find the same checkpoint (RunCheckpoint checks that every rank
        # starts at the same step); damaged files are skipped, whether moved aside yet or not.
        if auto:
            point = resume_point(cfg.resume, checkpoint_dir, global_batch_size)
        return _fit(cfg, trainer, module, datamodule, run_dir, checkpoint_dir, point)
    datamodule.setup("fit")  # bad data fails here, before the run directory is touched
    with RunDirectory(run_dir, checkpoint_dir) as directory:
        point = resume_point(cfg.resume, checkpoint_dir, global_batch_size)
        directory.start(cfg.resume, cfg.overwrite)
        if point is not None:
            _resume_from(point, trainer, checkpoint_dir, auto)
        directory.save_config(OmegaConf.to_yaml(cfg, resolve=True))
        return _fit(cfg, trainer, module, datamodule, run_dir, checkpoint_dir, point)


def _resume_from(point: ResumePoint, trainer: pl.Trainer, checkpoint_dir: Path, auto: bool) -> None:
    """Move aside ``point``'s damaged and superseded checkpoints; trim the later metrics."""
    where = f"{point.path} (step {point.step})" if point.path else "step 0 (no intact checkpoint)"
    for path, reason in point.damaged:
        moved = move_aside(path)
        log.warning(
            "resume=auto: %s does not load (%s); kept as %s. Resuming from %s instead.",
            path,
            reason,
            moved.name,
            where,
        )
    csv_logger = next(lg for lg in trainer.loggers if isinstance(lg, AppendingCSVLogger))
    csv_logger.keep_steps_up_to = point.step
    if auto and point.path is not None:
        print(f"resume=auto: resuming from {where}")
    elif auto and csv_logger.metrics_file.is_file():
        print(
            f"resume=auto: no checkpoint in {checkpoint_dir}: starting from step 0; the rows "
            f"of {csv_logger.metrics_file} are replaced as the steps are trained again."
        )
    else:
        for path in point.superseded:
            moved = move_aside(path, "superseded")
            log.warning(
                "%s is after step %d, which this run resumes from and trains again: kept as %s.",
                path,
                point.step,
                moved.name,
            )


@contextmanager
def _ending_the_process_group_it_starts() -> Iterator[None]:
    started_before = torch.distributed.is_initialized()
    try:
        yield
    finally:
        if torch.distributed.is_initialized() and not started_before:
            # Lightning ends NCCL groups only (lightning/fabric/utilities/distributed.py,
            # _init_dist_connection); a gloo group left to the interpreter's shutdown aborts the
            # process at random once the run is over ("terminate called without an active
            # exception": a worker thread frees its last collective's tensors after Python is
            # gone, pytorch/pytorch#179291). Ended here, it and its threads are gone first.
            torch.distributed.destroy_process_group()


@_ending_the_process_group_it_starts()
def _fit(
    cfg: DictConfig,
    trainer: pl.Trainer,
    module: ESM2MLMModule,
    datamodule: ESMDataModule,
    run_dir: Path,
    checkpoint_dir: Path,
    point: ResumePoint | None,
) -> dict[str, Any]:
    stopper = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=point and point.path)
    except SIGTERMException:
        # StopOnSignal stops this way at a step boundary; Lightning's own handler does before
        # training starts (sanity check).
        stopper.stop_signal = stopper.stop_signal or signal.SIGTERM
    if stopper.stop_signal is not None:
        for logger in trainer.loggers:
            logger.save()
        if trainer.is_global_zero:
            name = signal.Signals(stopper.stop_signal).name
            if trainer.checkpoint_callback is None:
                print(f"Stopped by {name} after step {trainer.global_step}; checkpointing is off.")
            else:
                last = checkpoint_dir / LAST_NAME
                again = (
                    "Continue with the same command (resume=auto)."
                    if cfg.resume == AUTO
                    else f"Continue with the same command plus resume=auto (or resume={last})."
                )
                print(
                    f"Stopped by {name} after step {trainer.global_step}; its checkpoint is "
                    f"{last}. {again}"
                )
        raise TrainingStopped(128 + stopper.stop_signal)
    if cfg.validate_at_end and module.last_validation_step != trainer.global_step:
        # A run resumed from its final checkpoint may have validated that step on file: its
        # validation rows came after that checkpoint was in place.
        key = OmegaConf.select(cfg, "callbacks.val_perplexity.loss_key", default="val_loss")
        on_file = trainer.is_global_zero and any(
            row.get(key) and float(row["step"]) == trainer.global_step
            for row in read_metrics(run_dir / METRICS_FILE)[1]
        )
        if not trainer.strategy.broadcast(on_file):
            trainer.validate(module, datamodule=datamodule, verbose=False)
    return _finish(cfg, trainer, run_dir)


def _finish(cfg: DictConfig, trainer: pl.Trainer, run_dir: Path) -> dict[str, Any]:
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.save()
        # A run resumed from its final checkpoint logs nothing: its values are on file.
        for row in read_metrics(run_dir / METRICS_FILE)[1]:
            for key, value in row.items():
                if key != "step" and value and key not in trainer.callback_metrics:
                    metrics[key] = float(value)
        outputs = [METRICS_FILE, "config.yaml", "checkpoints/"]
        if cfg.plot:
            plot_metrics(run_dir / METRICS_FILE, run_dir / "curves.png")
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
