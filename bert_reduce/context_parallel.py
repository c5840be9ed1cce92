"""Context-parallel (CP) slicing: which sequence positions each CP rank holds.

One rule for padded and packed batches: ``docs/packing.md#the-context-parallel-slicing-rule``.
A batch's ``num_scored`` is never sliced: on the host it is counted again for the shard; on a
device the whole micro-batch's count is kept, an upper bound for the shard (exact, for about
``cp_size`` times the shard's rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from bert_reduce import distributed
from bert_reduce.num_scored import NUM_SCORED_KEY, count_scored

_PACKED_BOUNDARY_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def packed_context_parallel_indices(
    cu_seqlens_padded: Tensor, total: int, cp_size: int, cp_rank: int
) -> Tensor:
    """Positions of a row of sequences held by one context-parallel rank; no host sync.

    The rule of ``docs/packing.md``, applied to each sequence
    ``[cu_seqlens_padded[i], cu_seqlens_padded[i + 1])``.

    Args:
        cu_seqlens_padded: ``[n + 1]`` boundaries, every length a multiple of ``2 * cp_size``.
        total: ``T``, the row's length (``cu_seqlens_padded[-1]``).
        cp_size: Context-parallel world size.
        cp_rank: This rank, in ``[0, cp_size)``.

    Returns:
        ``[total // cp_size]`` int64 positions, increasing.

    Raises:
        ValueError: If the rank is invalid or ``total`` is not a multiple of ``2 * cp_size``.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"Invalid context-parallel rank {cp_rank} for cp_size={cp_size}.")
    if total % (2 * cp_size) != 0:
        raise ValueError(
            f"Sequence length {total} must be divisible by 2 * cp_size = {2 * cp_size} for "
            f"load-balanced context parallelism; pad (or pack with pad_to_multiple_of="
            f"{2 * cp_size}) first."
        )
    bounds = cu_seqlens_padded.to(torch.int64)
    positions = torch.arange(total, device=bounds.device)
    seq_id = torch.searchsorted(bounds[1:], positions, right=True).clamp(max=bounds.numel() - 2)
    start, length = bounds[seq_id], bounds[seq_id + 1] - bounds[seq_id]
    chunk = (positions - start) * (2 * cp_size) // length
    keep = (chunk == cp_rank) | (chunk == 2 * cp_size - 1 - cp_rank)
    # A stable sort of the complement puts the kept positions first, in order, and their
    # number is static (total // cp_size), so no data-dependent `nonzero` is needed.
    return torch.argsort((~keep).to(torch.int8), stable=True)[: total // cp_size]


def context_parallel_indices(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> Tensor:
    """Positions of a ``[b, s]`` row held by one context-parallel rank (Megatron's order).

    :func:`packed_context_parallel_indices` for one sequence of length ``seq_len``.

    Args:
        seq_len: Full sequence length; must be a multiple of ``2 * cp_size``.
        cp_size: Context-parallel world size.
        cp_rank: This rank, in ``[0, cp_size)``.
        device: Where to put the indices.

    Returns:
        ``[seq_len // cp_size]`` int64 positions, increasing.

    Raises:
        ValueError: If ``seq_len`` is not divisible by ``2 * cp_size`` or the rank is invalid.

    Example:
        >>> context_parallel_indices(8, cp_size=2, cp_rank=0)  # chunks 0 and 3 of 4
        tensor([0, 1, 6, 7])
    """
    bounds = torch.tensor([0, seq_len], dtype=torch.int64, device=device)
    return packed_context_parallel_indices(bounds, seq_len, cp_size, cp_rank)


def slice_for_context_parallel(tensor: Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """This context-parallel rank's shard of ``tensor`` along ``seq_dim``."""
    if cp_size == 1:
        return tensor
    index = context_parallel_indices(tensor.size(seq_dim), cp_size, cp_rank, tensor.device)
    return tensor.index_select(seq_dim, index)


def _recounted(sliced: dict[str, Any]) -> dict[str, Any]:
    """``sliced``, a host batch's ``num_scored`` counted again (per sample if it was so)."""
    scored = sliced.get("loss_mask", sliced.get("labels"))
    if NUM_SCORED_KEY in sliced and isinstance(scored, Tensor) and scored.device.type == "cpu":
        num_scored = sliced[NUM_SCORED_KEY]
        per_sample = isinstance(num_scored, tuple | list) or (
            isinstance(num_scored, Tensor) and num_scored.dim() == 1
        )
        sliced[NUM_SCORED_KEY] = count_scored(sliced, per_sample=per_sample)
    return sliced


def _resolve(cp_size: int | None, cp_rank: int | None) -> tuple[int, int]:
    cp_size = distributed.context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = distributed.context_parallel_rank() if cp_rank is None else cp_rank
    return cp_size, cp_rank


def get_batch_on_this_cp_rank(
    batch: Mapping[str, Any],
    cp_size: int | None = None,
    cp_rank: int | None = None,
    seq_dims: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """``[b, s, ...]`` batch -> this context-parallel rank's ``[b, s / cp, ...]`` slice of it.

    The slice Megatron expects, in a new dict, as ``docs/packing.md`` says (``attention_mask``
    ``[b, 1, s, s]`` along dim 2); ``num_scored`` becomes this shard's count (module docstring).

    Args:
        batch: The full micro-batch, e.g. ``labels`` and ``loss_mask`` of shape ``[b, s]``.
        cp_size: Context-parallel size; Megatron's when ``None`` (1 without Megatron).
        cp_rank: Context-parallel rank; Megatron's when ``None`` (0 without Megatron).
        seq_dims: Per-key sequence dimension overrides; ``None`` passes a key through.

    Returns:
        The sliced batch; with ``cp_size == 1`` a shallow copy of ``batch``.

    Raises:
        ValueError: If a sliced tensor's sequence length is not a multiple of ``2 * cp_size``.

    Example:
        >>> batch = {"labels": torch.arange(8).view(1, 8), "loss_mask": torch.ones(1, 8)}
        >>> get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=1)["labels"]
        tensor([[2, 3, 4, 5]])
    """
    cp_size, cp_rank = _resolve(cp_size, cp_rank)
    dims: dict[str, int | None] = {}
    attention_mask = batch.get("attention_mask")
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        dims["attention_mask"] = 2
    dims.update(seq_dims or {})
    dims[NUM_SCORED_KEY] = None  # a count, never sliced: recounted below
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
    return _recounted(sliced) if cp_size > 1 else sliced


def get_packed_batch_on_this_cp_rank(
    batch: Mapping[str, Any], cp_size: int | None = None, cp_rank: int | None = None
) -> dict[str, Any]:
    """Slice a packed ``[1, T, ...]`` batch for one context-parallel rank.

    Every ``[1, T, ...]`` tensor is sliced along dim 1, the rest passes through, as
    ``docs/packing.md`` says; ``num_scored`` becomes this shard's count (module docstring).

    Args:
        batch: A batch from :func:`bert_reduce.packing.pack_batch` (``pad_to_multiple_of`` a
            multiple of ``2 * cp_size``).
        cp_size: As in :func:`get_batch_on_this_cp_rank`.
        cp_rank: As in :func:`get_batch_on_this_cp_rank`.

    Returns:
        The sliced batch; with ``cp_size == 1`` a shallow copy of ``batch``.

    Raises:
        KeyError: If ``cu_seqlens_padded`` is missing.
        ValueError: If a padded sequence length is not a multiple of ``2 * cp_size`` (this
            check reads ``cu_seqlens_padded`` on the host).
    """
    cp_size, cp_rank = _resolve(cp_size, cp_rank)
    if cp_size == 1:
        return dict(batch)
    if "cu_seqlens_padded" not in batch:
        raise KeyError(f"A packed batch needs 'cu_seqlens_padded'; it has {sorted(batch)}.")
    bounds = batch["cu_seqlens_padded"]
    padded_lengths = [int(n) for n in bounds.diff()]
    if any(n % (2 * cp_size) for n in padded_lengths):
        raise ValueError(
            f"Padded sequence lengths {padded_lengths} must be multiples of 2 * cp_size = "
            f"{2 * cp_size}; pack with pad_to_multiple_of={2 * cp_size}."
        )
    total = int(bounds[-1])
    index = packed_context_parallel_indices(bounds, total, cp_size, cp_rank)
    sliced: dict[str, Any] = {}
    for key, value in batch.items():
        if key not in _PACKED_BOUNDARY_KEYS and isinstance(value, Tensor) and value.dim() >= 2:
            if tuple(value.shape[:2]) == (1, total):
                value = value.index_select(1, index.to(value.device))
        sliced[key] = value
    return _recounted(sliced)
