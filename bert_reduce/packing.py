"""Packed sequences (THD): a ``[b, s]`` BERT batch as one ``[1, T]`` row with ``cu_seqlens``.

Packing drops every padding token of the ``[b, s]`` batch, so padding can never be scored.
When sequences are padded to a multiple of ``2 * cp_size`` for load-balanced context
parallelism (as Transformer Engine's THD attention requires), the packed row holds each
sequence followed by its own padding: ``cu_seqlens`` gives the real boundaries (what attention
uses), ``cu_seqlens_padded`` the padded ones (where each sequence starts in the row).

Context parallelism then splits every padded sequence by the one CP rule of
:mod:`bert_reduce.context_parallel`; ``cu_seqlens`` stay global on every rank.

Packing reads the lengths on the host: it belongs to the data pipeline, not the step.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from bert_reduce.normalization import sequence_normalizers

__all__ = [
    "pack_batch",
    "unpack_sequences",
]

_PAD_VALUES: dict[str, int | float] = {"labels": -100}


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
    and ``sequence_start`` (see :func:`bert_reduce.normalization.sequence_normalizers`) so that the
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
        ValueError: On an empty batch (``b == 0``), a length outside ``[1, s]``, a non
            right-padded ``attention_mask``, no lengths at all, or ``pad_to_multiple_of < 1``.
        TypeError: On lengths that are not integers (floats are not truncated).
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}.")
    candidates = [batch.get(key) for key in ("labels", "loss_mask", "input_ids")]
    candidates += [v for k, v in batch.items() if k != "attention_mask"]
    reference = next((v for v in candidates if isinstance(v, Tensor) and v.dim() >= 2), None)
    if reference is None:
        raise ValueError(f"pack_batch needs a [b, s, ...] tensor; got {sorted(batch)}.")
    batch_size, seq_len = reference.shape[:2]
    if batch_size == 0:
        raise ValueError(
            f"pack_batch got a batch of b = 0 sequences (shape {tuple(reference.shape)}): "
            "there is nothing to pack; skip empty batches before packing."
        )
    device = reference.device
    if lengths is None:
        if "attention_mask" not in batch:
            raise ValueError("pack_batch needs lengths or a [b, s] batch['attention_mask'].")
        lengths = _lengths_from_attention_mask(batch["attention_mask"])
    try:
        # operator.index, not int(): a float length (2.7) must not be truncated silently.
        lengths_list = [operator.index(n) for n in lengths]
    except TypeError:
        raise TypeError(
            f"lengths must be integers (a list of ints or an integer tensor), got "
            f"{lengths!r}; round or cast them explicitly."
        ) from None
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
        ValueError: If ``seq_dim`` is not 0 or 1, ``packed`` is not ``[1, T, ...]`` /
            ``[T, 1, ...]`` as ``seq_dim`` says, the boundaries reach past ``T``, or a sequence
            is longer than ``seq_len``.
    """
    if seq_dim not in (0, 1):
        raise ValueError(f"seq_dim must be 0 ([T, 1, ...]) or 1 ([1, T, ...]), got {seq_dim}.")
    expected = "[T, 1, ...]" if seq_dim == 0 else "[1, T, ...]"
    if packed.dim() < 2 or packed.size(1 - seq_dim) != 1:
        raise ValueError(
            f"unpack_sequences with seq_dim={seq_dim} needs packed of shape {expected}, got "
            f"{tuple(packed.shape)}. A packed [T] or [T, v] tensor needs its batch dim of 1: "
            "packed.unsqueeze(0) with seq_dim=1, or packed.unsqueeze(1) with seq_dim=0."
        )
    boundaries = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    total = packed.size(seq_dim)
    if int(boundaries[-1]) > total:
        raise ValueError(
            f"The sequence boundaries end at {int(boundaries[-1])}, past the {total} packed "
            f"positions of packed {tuple(packed.shape)} (dim {seq_dim})."
        )
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
