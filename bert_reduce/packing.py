"""Packed sequences (THD): a ``[b, s]`` BERT batch as one ``[1, T]`` row with ``cu_seqlens``.

Packing drops every padding token of the ``[b, s]`` batch, so padding can never be scored.
When sequences are padded to a multiple of ``2 * cp_size`` for load-balanced context
parallelism (as Transformer Engine's THD attention requires), the packed row holds each
sequence followed by its own padding: ``cu_seqlens`` gives the real boundaries (what attention
uses), ``cu_seqlens_padded`` the padded ones (where each sequence starts in the row).

Context parallelism then cuts each padded sequence into ``2 * cp_size`` equal chunks and gives
rank ``r`` chunks ``r`` and ``2 * cp_size - 1 - r`` of every sequence, as Transformer Engine's
``thd_get_partitioned_indices`` does. ``cu_seqlens`` stay global on every rank.

Packing reads the lengths on the host: it belongs to the data pipeline, not the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from bert_reduce import distributed
from bert_reduce.normalization import sequence_normalizers

__all__ = [
    "get_packed_batch_on_this_cp_rank",
    "pack_batch",
    "packed_context_parallel_indices",
    "unpack_sequences",
]

_PAD_VALUES: dict[str, int | float] = {"labels": -100}
_BOUNDARY_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def _lengths_from_attention_mask(attention_mask: Tensor) -> Tensor:
    if attention_mask.dim() != 2:
        raise ValueError(
            "Without lengths, batch['attention_mask'] must be a [b, s] padding mask, got shape "
            f"{tuple(attention_mask.shape)}."
        )
    valid = attention_mask != 0
    lengths = valid.sum(dim=1)
    positions = torch.arange(valid.size(1), device=valid.device)
    if not torch.equal(valid, positions < lengths[:, None]):
        raise ValueError(
            "batch['attention_mask'] must be right-padded (ones, then zeros) to derive lengths; "
            "pass lengths explicitly otherwise."
        )
    return lengths


def _packing_indices(
    lengths: Sequence[int], pad_to_multiple_of: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    padded = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in lengths]
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    cu_seqlens_padded = torch.tensor([0, *padded], dtype=torch.int64).cumsum(0)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    cols = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0)
    dest = cu_seqlens_padded[rows] + cols
    return rows, cols.long(), dest, torch.stack([cu_seqlens, cu_seqlens_padded])


def pack_batch(
    batch: Mapping[str, Any],
    lengths: Tensor | Sequence[int] | None = None,
    *,
    pad_to_multiple_of: int = 1,
    pad_values: Mapping[str, int | float] | None = None,
) -> dict[str, Any]:
    """Pack a ``[b, s, ...]`` batch into one ``[1, T, ...]`` row.

    Every tensor whose first two dims are ``[b, s]`` is packed (sequence ``i`` keeps its
    first ``lengths[i]`` tokens); other values pass through, except ``attention_mask``, which
    ``cu_seqlens`` replace. With a ``loss_mask``, the result also holds ``sequence_weight``
    and ``sequence_start`` (see :func:`bert_reduce.sequence_normalizers`) so that the
    per-sequence and constant normalizations stay exact after context-parallel slicing.

    Args:
        batch: e.g. ``input_ids``, ``labels`` and ``loss_mask`` of shape ``[b, s]``.
        lengths: ``[b]`` number of real tokens per row (each at least 1); from a right-padded
            ``[b, s]`` ``batch["attention_mask"]`` when omitted.
        pad_to_multiple_of: Pad each sequence to a multiple of this (``2 * cp_size`` for
            context parallelism).
        pad_values: Fill value of padding slots per key; 0 by default, -100 for ``labels``.

    Returns:
        The packed batch, plus ``cu_seqlens`` and ``cu_seqlens_padded`` (``[b + 1]`` int32,
        on the batch's device) and ``max_seqlen`` (an int, the longest padded sequence).

    Raises:
        ValueError: On a length outside ``[1, s]``, a non right-padded ``attention_mask``, no
            lengths at all, or ``pad_to_multiple_of < 1``.
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}.")
    candidates = [batch.get(key) for key in ("labels", "loss_mask", "input_ids")]
    candidates += [v for k, v in batch.items() if k != "attention_mask"]
    reference = next((v for v in candidates if isinstance(v, Tensor) and v.dim() >= 2), None)
    if reference is None:
        raise ValueError(f"pack_batch needs a [b, s, ...] tensor; got {sorted(batch)}.")
    batch_size, seq_len = reference.shape[:2]
    device = reference.device
    if lengths is None:
        if "attention_mask" not in batch:
            raise ValueError("pack_batch needs lengths or a [b, s] batch['attention_mask'].")
        lengths = _lengths_from_attention_mask(batch["attention_mask"])
    lengths_list = [int(n) for n in lengths]
    if len(lengths_list) != batch_size or not all(1 <= n <= seq_len for n in lengths_list):
        raise ValueError(
            f"lengths must be {batch_size} values in [1, {seq_len}] for a [b, s] = "
            f"{[batch_size, seq_len]} batch, got {lengths_list}."
        )
    rows, cols, dest, boundaries = _packing_indices(lengths_list, pad_to_multiple_of)
    rows, cols, dest = rows.to(device), cols.to(device), dest.to(device)
    total = int(boundaries[1, -1])
    fill = {**_PAD_VALUES, **(pad_values or {})}

    packed: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        if isinstance(value, Tensor) and tuple(value.shape[:2]) == (batch_size, seq_len):
            out = value.new_full((total, *value.shape[2:]), fill.get(key, 0))
            out[dest] = value[rows, cols]
            value = out.unsqueeze(0)
        packed[key] = value
    packed["cu_seqlens"] = boundaries[0].to(device=device, dtype=torch.int32)
    packed["cu_seqlens_padded"] = boundaries[1].to(device=device, dtype=torch.int32)
    packed["max_seqlen"] = int(boundaries[1].diff().max())
    if "loss_mask" in packed:
        weight, start = sequence_normalizers(packed["loss_mask"], packed["cu_seqlens_padded"])
        packed["sequence_weight"], packed["sequence_start"] = weight, start
    return packed


def unpack_sequences(
    packed: Tensor,
    cu_seqlens: Tensor,
    seq_len: int,
    *,
    cu_seqlens_padded: Tensor | None = None,
    seq_dim: int = 1,
    pad_value: float = 0,
) -> Tensor:
    """Scatter a packed tensor back to one row per sequence; differentiable.

    Args:
        packed: ``[1, T, ...]`` (``seq_dim=1``, e.g. labels) or ``[T, 1, ...]``
            (``seq_dim=0``, e.g. ``[s, b, v]``-style logits).
        cu_seqlens: ``[n + 1]`` real boundaries.
        seq_len: ``s`` of the result (at least the longest sequence).
        cu_seqlens_padded: ``[n + 1]`` padded boundaries, when sequences were padded.
        seq_dim: Which of the first two dims is the packed one.
        pad_value: Fill value past each sequence's length.

    Returns:
        ``[n, seq_len, ...]`` for ``seq_dim=1``, ``[seq_len, n, ...]`` for ``seq_dim=0``.

    Raises:
        ValueError: If ``seq_dim`` is not 0 or 1, or a sequence is longer than ``seq_len``.
    """
    if seq_dim not in (0, 1):
        raise ValueError(f"seq_dim must be 0 ([T, 1, ...]) or 1 ([1, T, ...]), got {seq_dim}.")
    flat = packed[:, 0] if seq_dim == 0 else packed[0]
    lengths = [int(n) for n in cu_seqlens.diff()]
    if any(n > seq_len for n in lengths):
        raise ValueError(f"A sequence of length {max(lengths)} does not fit seq_len={seq_len}.")
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    cols = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0).long()
    starts = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded).long().cpu()
    dest = (starts[rows] + cols).to(flat.device)
    out = flat.new_full((len(lengths), seq_len, *flat.shape[1:]), pad_value)
    out = out.index_put((rows.to(flat.device), cols.to(flat.device)), flat[dest])
    return out.transpose(0, 1) if seq_dim == 0 else out


def packed_context_parallel_indices(
    cu_seqlens_padded: Tensor, total: int, cp_size: int, cp_rank: int
) -> Tensor:
    """Positions of a packed row held by one context-parallel rank; no host sync.

    Each padded sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds chunks
    ``r`` and ``2 * cp_size - 1 - r`` of every sequence, in increasing position order.

    Args:
        cu_seqlens_padded: ``[n + 1]`` padded boundaries; every padded length a multiple of
            ``2 * cp_size`` and ``cu_seqlens_padded[-1] == total``.
        total: ``T``, the packed row's length.
        cp_size: Context-parallel world size.
        cp_rank: This rank, in ``[0, cp_size)``.

    Returns:
        ``[total // cp_size]`` int64 positions.

    Raises:
        ValueError: If the rank is invalid or ``total`` is not a multiple of ``2 * cp_size``.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"Invalid context-parallel rank {cp_rank} for cp_size={cp_size}.")
    if total % (2 * cp_size) != 0:
        raise ValueError(
            f"Packed length {total} must be divisible by 2 * cp_size = {2 * cp_size}; pack "
            f"with pad_to_multiple_of={2 * cp_size}."
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


def get_packed_batch_on_this_cp_rank(
    batch: Mapping[str, Any], cp_size: int | None = None, cp_rank: int | None = None
) -> dict[str, Any]:
    """Slice a packed ``[1, T, ...]`` batch for one context-parallel rank.

    Every tensor whose first two dims are ``[1, T]`` is sliced along dim 1 (see
    :func:`packed_context_parallel_indices`); ``cu_seqlens``, ``cu_seqlens_padded``,
    ``max_seqlen`` and other values pass through unchanged, as Transformer Engine expects.

    Args:
        batch: A batch from :func:`pack_batch` (``pad_to_multiple_of`` a multiple of
            ``2 * cp_size``).
        cp_size: Context-parallel size; Megatron's when ``None`` (1 without Megatron).
        cp_rank: Context-parallel rank; Megatron's when ``None`` (0 without Megatron).

    Returns:
        The sliced batch; with ``cp_size == 1`` a shallow copy of ``batch``.

    Raises:
        KeyError: If ``cu_seqlens_padded`` is missing.
        ValueError: If a padded sequence length is not a multiple of ``2 * cp_size`` (this
            check reads ``cu_seqlens_padded`` on the host).
    """
    cp_size = distributed.context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = distributed.context_parallel_rank() if cp_rank is None else cp_rank
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
    index: Tensor | None = None
    sliced: dict[str, Any] = {}
    for key, value in batch.items():
        if key not in _BOUNDARY_KEYS and isinstance(value, Tensor) and value.dim() >= 2:
            if tuple(value.shape[:2]) == (1, total):
                if index is None:
                    index = packed_context_parallel_indices(bounds, total, cp_size, cp_rank)
                value = value.index_select(1, index.to(value.device))
        sliced[key] = value
    return sliced
