"""A NeMo 2 recipe (a ``nemo_run`` ``run.Partial`` of ``llm.pretrain``) with bert_reduce's loss.

NeMo 2 recipes are fiddle configs: nothing is built until the run executes, so the loss class
and its options are configured *in* the recipe, as a ``run.Partial`` that the model calls
once per micro-batch (BioNeMo's ``loss_reduction_class``)::

    recipe = mlm_pretrain_recipe(
        model=run.Config(MyBertModule, config=run.Config(TransformerConfig, ...)),
        data=run.Config(MyDataModule, ...),
        devices=8,
    )
    recipe.model.loss_reduction_class = run.Partial(
        BERTMLMLossWithReduction, normalization="per_sequence"
    )
    run.run(recipe, executor=run.LocalExecutor(ntasks_per_node=8, launcher="torchrun"))

The recipe sets the two Megatron flags the exact per-token reduction needs:
``calculate_per_token_loss=True`` on the model's ``TransformerConfig`` and
``average_in_collective=False`` on Megatron's DDP config (gradients are summed over data
parallel ranks and divided once by the global token count in ``finalize_model_grads``).
``tests/nemo/test_checkpoint.py`` checks its configuration around a tiny Megatron BERT and
executes it.
"""

from __future__ import annotations

from typing import Any

import nemo_run as run
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from nemo import lightning as nl
from nemo.collections import llm
from nemo.lightning.pytorch.optim import MegatronOptimizerModule

from bert_reduce import BERTMLMLossWithReduction

__all__ = ["mlm_pretrain_recipe"]


def mlm_pretrain_recipe(
    model: run.Config,
    data: run.Config,
    *,
    devices: int = 1,
    accelerator: str = "gpu",
    pipeline_model_parallel_size: int = 1,
    max_steps: int = 100,
    lr: float = 1e-4,
    log_dir: str = "nemo_experiments",
    loss_options: dict[str, Any] | None = None,
    trainer_options: dict[str, Any] | None = None,
    optimizer_options: dict[str, Any] | None = None,
) -> run.Partial:
    """``llm.pretrain`` as a ``run.Partial``, with bert_reduce's loss and Megatron flags.

    Args:
        model: The LightningModule's config; its ``config`` field must be a
            ``TransformerConfig`` config and it must take ``loss_reduction_class``.
        data: The data module's config (with a ``MegatronDataSampler``).
        devices: Processes per node.
        accelerator: ``"gpu"``; ``"cpu"`` for gloo tests.
        pipeline_model_parallel_size: Pipeline stages.
        max_steps: Optimizer steps.
        lr: Adam's learning rate.
        log_dir: Where NeMo's logger writes.
        loss_options: Keyword arguments of :class:`~bert_reduce.BERTMLMLossWithReduction`
            (``normalization``, ``capacity``, ...).
        trainer_options: Extra ``nl.Trainer`` arguments (callbacks, precision plugin, ...).
        optimizer_options: Extra ``OptimizerConfig`` fields.

    Returns:
        The recipe; change any field before running it.
    """
    model.config.calculate_per_token_loss = True
    model.loss_reduction_class = run.Partial(BERTMLMLossWithReduction, **(loss_options or {}))
    strategy = run.Config(
        nl.MegatronStrategy,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        ddp=run.Config(DistributedDataParallelConfig, average_in_collective=False),
    )
    trainer = run.Config(
        nl.Trainer,
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        **(trainer_options or {}),
    )
    optimizer = run.Config(
        MegatronOptimizerModule,
        config=run.Config(
            OptimizerConfig,
            **{"optimizer": "adam", "lr": lr, "use_distributed_optimizer": False}
            | (optimizer_options or {}),
        ),
    )
    return run.Partial(
        llm.pretrain,
        model=model,
        data=data,
        trainer=trainer,
        optim=optimizer,
        log=run.Config(nl.NeMoLogger, log_dir=log_dir),
    )
