"""Which process groups the loss reduces over, and the one all-reduce.

Megatron-Core's groups when its parallel state is initialized, else TP = CP = 1
(``docs/megatron.md``). Megatron-Core is never imported from here: if its parallel state is in
use, the module is already in ``sys.modules``; looking it up there keeps ``import bert_reduce``
fast.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.distributed as dist
from torch import Tensor

_PARALLEL_STATE = "megatron.core.parallel_state"


@torch.compiler.assume_constant_result
def megatron_is_initialized() -> bool:
    """Whether Megatron-Core is imported and its model-parallel groups initialized.

    Under ``torch.compile`` this is read once, when a graph is compiled, and kept as a
    constant: traced, the ``sys.modules`` lookup would guard on the length of
    ``sys.modules``, which every later import (inductor's own, while compiling) changes,
    recompiling every graph. Megatron's parallel state is set up before the first step.
    """
    parallel_state = sys.modules.get(_PARALLEL_STATE)
    return parallel_state is not None and parallel_state.model_parallel_is_initialized()


def _parallel_state() -> ModuleType | None:
    return sys.modules[_PARALLEL_STATE] if megatron_is_initialized() else None


def tensor_parallel_group() -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group, or ``None`` without Megatron's parallel state."""
    parallel_state = _parallel_state()
    return None if parallel_state is None else parallel_state.get_tensor_model_parallel_group()


def tensor_parallel_world_size() -> int:
    """Number of vocab shards the logits are split into (1 without Megatron)."""
    parallel_state = _parallel_state()
    return 1 if parallel_state is None else parallel_state.get_tensor_model_parallel_world_size()


def context_parallel_world_size() -> int:
    """Number of sequence shards (1 without Megatron)."""
    parallel_state = _parallel_state()
    return 1 if parallel_state is None else parallel_state.get_context_parallel_world_size()


def context_parallel_rank() -> int:
    """This rank's index among the sequence shards (0 without Megatron)."""
    parallel_state = _parallel_state()
    return 0 if parallel_state is None else parallel_state.get_context_parallel_rank()


def loss_reduction_group() -> dist.ProcessGroup | None:
    """The group whose token sums make up the global batch.

    Megatron's data x context parallel group when initialized; else the default group when
    ``torch.distributed`` is; else ``None`` (a single process: nothing to reduce).
    """
    parallel_state = _parallel_state()
    if parallel_state is not None:
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def all_reduce_sum_(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum ``tensor`` in place over ``group``; a no-op when ``group`` is ``None``."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def default_device() -> torch.device:
    """The current accelerator if there is one, else the CPU."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
