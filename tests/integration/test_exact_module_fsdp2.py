"""ExactMLMModule under Lightning's ModelParallelStrategy (FSDP2) on 2 gloo processes.

The parameters after every step equal those of one process training on the whole global
batch with ``F.cross_entropy`` (tests/helpers/exact_training.py's reference), in every
normalization mode, with micro-batches holding no masked token and a rank holding none.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from tests.helpers import exact_training as et
from tests.helpers.dist_utils import join_existing_group, run_distributed

pytestmark = pytest.mark.slow


def existing_group_fsdp2() -> ModelParallelStrategy:
    """FSDP2 over the process group ``run_distributed`` already initialized."""
    join_existing_group()
    strategy = ModelParallelStrategy(
        data_parallel_size=dist.get_world_size(),
        tensor_parallel_size=1,
        process_group_backend="gloo",
    )
    strategy.cluster_environment = LightningEnvironment()
    return strategy


def _full(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in params.items()}


def _body(world_size: int) -> None:
    for mode, micro_batch_size in (("per_token", 1), ("per_token", 2), ("per_sequence", 2)):
        # The first run's loader counts each sample's scored positions; every micro-batch's
        # loss gets its own count as an int through FSDP2's batch transfer and the split.
        count_scored = micro_batch_size == 1
        expected, expected_losses = et.reference_train(et.sgd(), clip=None, mode=mode)
        run = et.lightning_train(
            micro_batch_size=micro_batch_size,
            optimizer=et.sgd(),
            clip=None,
            strategy=existing_group_fsdp2(),
            devices=world_size,
            mode=mode,
            # ModelParallelStrategy refuses "64-true"; "32-true" leaves the fp64 model as is.
            precision="32-true",
            model_dtype=torch.float64,
            count_scored=count_scored,
        )
        if count_scored:
            et.assert_each_loss_got_its_micro_batch_count()
        assert any(isinstance(p, DTensor) for p in run.module.parameters())
        et.assert_params_close(_full(run.params), expected)
        torch.testing.assert_close(run.losses, expected_losses, rtol=1e-12, atol=0)
    dist.barrier()


def test_model_parallel_strategy_training_equals_one_process() -> None:
    run_distributed(_body, 2, 2, megatron=False)
