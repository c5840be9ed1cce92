"""Run a real NeMo 2 fit of :class:`~tests.nemo.tiny_bert.TinyBertMLM` in fresh processes.

``nl.Trainer`` + ``nl.MegatronStrategy`` (Megatron DDP with ``average_in_collective=False``) +
``MegatronOptimizerModule`` (Megatron's SGD, gradient clipping, ``finalize_model_grads``), on
CPU/gloo with only :mod:`tests.nemo.cpu_stand_ins`. Each rank saves what it saw to
``<out_dir>/rank<r>.pt``: its global parameter names and values, its pipeline rank, and the
``reduced_train_loss`` NeMo logged at every step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.optimizer import OptimizerConfig
from nemo import lightning as nl
from nemo.lightning.pytorch.optim import MegatronOptimizerModule
from typing_extensions import override

from tests.nemo.cpu_stand_ins import megatron_on_cpu
from tests.nemo.tiny_bert import (
    CLIP_GRAD,
    LR,
    MOMENTUM,
    TinyBertDataModule,
    TinyBertMLM,
    global_named_parameters,
    run_processes,
    tiny_bert_config,
)


class LossRecorder(pl.Callback):
    """Keeps ``reduced_train_loss`` as NeMo logged it after every training step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["reduced_train_loss"]))


class ResultSaver(LossRecorder):
    """A :class:`LossRecorder` that saves this rank's result at the end of the fit.

    For runs built elsewhere (a ``nemo_run`` recipe): ``<out_dir>/rank<r>.pt`` as
    :func:`save_rank_result` writes it, with the logged losses.
    """

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        save_rank_result(self.out_dir, pl_module, losses=self.losses)


def optimizer_module() -> MegatronOptimizerModule:
    """Megatron's SGD with momentum and clipping, as :func:`reference_training` runs it."""
    return MegatronOptimizerModule(
        OptimizerConfig(
            optimizer="sgd",
            lr=LR,
            sgd_momentum=MOMENTUM,
            weight_decay=0.0,
            clip_grad=CLIP_GRAD,
            use_distributed_optimizer=False,
        )
    )


def nemo_trainer(
    world_size: int, steps: int, pp: int = 1, tp: int = 1, **kwargs: Any
) -> nl.Trainer:
    """A NeMo 2 trainer with the Megatron flags the exact per-token reduction needs."""
    strategy = nl.MegatronStrategy(
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        ddp=DistributedDataParallelConfig(average_in_collective=False),
        ckpt_load_strictness="log_all",
    )
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world_size,
        "strategy": strategy,
        "max_steps": steps,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "logger": False,
        "plugins": nl.MegatronMixedPrecision(precision="32"),
    }
    options.update(kwargs)
    return nl.Trainer(**options)


def bert_of(module: pl.LightningModule) -> BertModel:
    """The Megatron BERT inside the (DDP-wrapped) LightningModule."""
    return next(m for m in module.modules() if isinstance(m, BertModel))


def save_rank_result(out_dir: str, module: pl.LightningModule, **extra: Any) -> None:
    """Write this rank's parameters and ``extra`` to ``<out_dir>/rank<r>.pt``."""
    named = global_named_parameters(bert_of(module))
    params = {name: param.detach().clone() for name, param in named.items()}
    result = {
        "params": params,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        **extra,
    }
    torch.save(result, Path(out_dir) / f"rank{os.environ['RANK']}.pt")


def _fit_body(
    out_dir: str, world_size: int, steps: int, pp: int, output: str, tp: int = 1
) -> None:
    recorder = LossRecorder()
    trainer = nemo_trainer(world_size, steps, pp, tp, callbacks=[recorder])
    config = tiny_bert_config(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp)
    model = TinyBertMLM(config, output=output)
    optimizer_module().connect(model)
    with megatron_on_cpu():
        trainer.fit(model, TinyBertDataModule(steps))
    save_rank_result(out_dir, model, losses=recorder.losses)


def fit(
    out_dir: str, world_size: int, steps: int, pp: int = 1, output: str = "logits", tp: int = 1
) -> list[dict[str, Any]]:
    """Fit on ``world_size`` processes (DP = ``world_size / (pp * tp)``); every rank's result."""
    run_processes(_fit_body, world_size, out_dir, world_size, steps, pp, output, tp)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]
