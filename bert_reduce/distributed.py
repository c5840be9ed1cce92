"""Which process groups the loss reduces over, context-parallel slicing, the one all-reduce.

With Megatron-Core's parallel state initialized, the groups are Megatron's: tensor parallel
for the vocab-sharded cross-entropy, data x context parallel for the token sums. Without it
(one process, plain ``torch.distributed``, Lightning DDP), TP = CP = 1 and the sums reduce
over the default process group when there is one.

Megatron-Core is never imported from here: if its parallel state is in use, the module is
already in ``sys.modules``; looking it up there keeps ``import bert_reduce`` fast.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_reduce_sum_",
    "context_parallel_indices",
    "context_parallel_rank",
    "context_parallel_world_size",
    "default_device",
    "get_batch_on_this_cp_rank",
    "loss_reduction_group",
    "megatron_is_initialized",
    "slice_for_context_parallel",
    "tensor_parallel_group",
    "tensor_parallel_world_size",
]

_PARALLEL_STATE = "megatron.core.parallel_state"


def _parallel_state() -> ModuleType | None:
    parallel_state = sys.modules.get(_PARALLEL_STATE)
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state


def megatron_is_initialized() -> bool:
    """Whether Megatron-Core's model-parallel groups are initialized in this process."""
    return _parallel_state() is not None


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


def context_parallel_indices(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> Tensor:
    """Sequence positions held by one context-parallel rank, in Megatron's load-balanced order.

    The sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds chunks ``r`` and
    ``2 * cp_size - 1 - r`` so that every rank gets the same share of causal-attention work.

    Args:
        seq_len: Full sequence length; must be a multiple of ``2 * cp_size``.
        cp_size: Context-parallel world size.
        cp_rank: This rank, in ``[0, cp_size)``.
        device: Where to put the indices.

    Returns:
        ``[seq_len // cp_size]`` int64 positions, increasing.

    Raises:
        ValueError: If ``seq_len`` is not divisible by ``2 * cp_size`` or the rank is invalid.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"Invalid context-parallel rank {cp_rank} for cp_size={cp_size}.")
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"Sequence length {seq_len} must be divisible by 2 * cp_size = {2 * cp_size} "
            "for load-balanced context parallelism; pad the batch first."
        )
    chunk = seq_len // (2 * cp_size)
    chunks = torch.arange(2 * cp_size * chunk, device=device).view(2 * cp_size, chunk)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def slice_for_context_parallel(tensor: Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """This context-parallel rank's shard of ``tensor`` along ``seq_dim`` (see above)."""
    if cp_size == 1:
        return tensor
    index = context_parallel_indices(tensor.size(seq_dim), cp_size, cp_rank, tensor.device)
    return tensor.index_select(seq_dim, index)


def get_batch_on_this_cp_rank(
    batch: Mapping[str, Any],
    cp_size: int | None = None,
    cp_rank: int | None = None,
    seq_dims: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Slice a ``[b, s, ...]`` batch for one context-parallel rank, as Megatron expects.

    Returns a new dict and leaves ``batch`` untouched. Tensors are sliced along dim 1
    (``attention_mask``: dim 2, as in Megatron) unless ``seq_dims`` says otherwise; values
    that are not tensors, and keys mapped to ``None`` in ``seq_dims``, pass through.

    Args:
        batch: The full micro-batch, e.g. ``labels`` and ``loss_mask`` of shape ``[b, s]``.
        cp_size: Context-parallel size; Megatron's when ``None`` (1 without Megatron).
        cp_rank: Context-parallel rank; Megatron's when ``None`` (0 without Megatron).
        seq_dims: Per-key sequence dimension overrides.

    Returns:
        The sliced batch; with ``cp_size == 1`` a shallow copy of ``batch``.

    Raises:
        ValueError: If a sliced tensor's sequence length is not a multiple of ``2 * cp_size``.
    """
    cp_size = context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = context_parallel_rank() if cp_rank is None else cp_rank
    dims: dict[str, int | None] = {"attention_mask": 2}
    dims.update(seq_dims or {})
    sliced: dict[str, Any] = {}
    for key, value in batch.items():
        seq_dim = dims.get(key, 1)
        if cp_size > 1 and isinstance(value, Tensor) and seq_dim is not None:
            if value.dim() <= seq_dim:
                raise ValueError(
                    f"batch[{key!r}] of shape {tuple(value.shape)} has no sequence dim {seq_dim}."
                )
            value = slice_for_context_parallel(value, seq_dim, cp_size, cp_rank)
        sliced[key] = value
    return sliced
