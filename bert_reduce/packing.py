"""Packed sequences (THD): a ``[b, s]`` BERT batch as one ``[1, T]`` row with ``cu_seqlens``.

Packing, its padded boundaries for context parallelism and the data-pipeline place it
belongs to: ``docs/packing.md``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from bert_reduce.functional import mask_weights
from bert_reduce.normalization import sequence_normalizers

SEQUENCE_BOUNDARY_KEYS = (
    "cu_seqlens_padded",
    "cu_seq_lens_q_padded",
    "cu_seqlens",
    "cu_seq_lens_q",
)
"""Keys of a packed ``[1, T]`` row's ``[n + 1]`` sequence boundaries, looked up in this order:
padded before real ones; ``cu_seq_lens_q*`` are Hugging Face's names."""

# Key prefixes of a packed batch (Hugging Face's, Transformer Engine's) that say nothing this
# library can read about where its sequences start.
_PACKING_HINT_PREFIXES = ("cu_seq", "max_length_", "max_seqlen", "seq_idx")

_PAD_VALUES: dict[str, int | float] = {"labels": -100}


def _token_indices(lengths: Sequence[int], starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(row, col, position)`` of every real token: ``position = starts[row] + col``."""
    rows = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths, dtype=torch.long))
    cols = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0).long()
    return rows, cols, starts.long().cpu()[rows] + cols


def pack_batch(
    batch: Mapping[str, Any],
    lengths: Tensor | Sequence[int] | None = None,
    *,
    pad_to_multiple_of: int = 1,
    pad_values: Mapping[str, int | float] | None = None,
) -> dict[str, Any]:
    """``[b, s, ...]`` batch -> one packed ``[1, T, ...]`` row, with its ``cu_seqlens``.

    Every tensor whose first two dims are ``[b, s]`` is packed (sequence ``i`` keeps its
    first ``lengths[i]`` tokens); other values pass through, except ``attention_mask``, which
    ``cu_seqlens`` replace. With a ``loss_mask``, the result also holds ``sequence_weight``
    and ``sequence_start`` (:func:`bert_reduce.normalization.sequence_normalizers`).

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
        ValueError: On an empty batch (``b == 0``), ``input_ids``, ``labels``, ``loss_mask``
            and ``attention_mask`` of different ``[b, s]`` (the message names them), a length
            outside ``[1, s]``, a non right-padded ``attention_mask``, no lengths at all, or
            ``pad_to_multiple_of < 1``.
        TypeError: On lengths that are not integers (floats are not truncated).

    Example:
        >>> batch = {"labels": torch.tensor([[5, 6, -100], [7, -100, -100]])}
        >>> packed = pack_batch(batch, [2, 1])
        >>> packed["labels"], packed["cu_seqlens"]
        (tensor([[5, 6, 7]]), tensor([0, 2, 3], dtype=torch.int32))
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}.")
    candidates = [batch.get(key) for key in ("labels", "loss_mask", "input_ids")]
    candidates += [v for k, v in batch.items() if k != "attention_mask"]
    reference = next((v for v in candidates if isinstance(v, Tensor) and v.dim() >= 2), None)
    if reference is None:
        raise ValueError(f"pack_batch needs a [b, s, ...] tensor; got {sorted(batch)}.")
    batch_size, seq_len = reference.shape[:2]
    shapes = {
        key: tuple(batch[key].shape[:2])
        for key in ("input_ids", "labels", "loss_mask", "attention_mask")
        if isinstance(batch.get(key), Tensor)
    }
    if len(set(shapes.values())) > 1:
        raise ValueError(
            f"pack_batch needs one [b, s] shape for every token tensor, got {shapes}: each "
            "sequence's labels and masks must line up with its input_ids."
        )
    if batch_size == 0:
        raise ValueError(
            f"pack_batch got a batch of b = 0 sequences (shape {tuple(reference.shape)}): "
            "there is nothing to pack; skip empty batches before packing."
        )
    device = reference.device
    if lengths is None:
        if "attention_mask" not in batch:
            raise ValueError("pack_batch needs lengths or a [b, s] batch['attention_mask'].")
        valid = batch["attention_mask"] != 0
        if valid.dim() != 2:
            raise ValueError(
                "Without lengths, batch['attention_mask'] must be a [b, s] padding mask, got "
                f"shape {tuple(valid.shape)}."
            )
        lengths = valid.sum(dim=1)
        positions = torch.arange(valid.size(1), device=valid.device)
        if not torch.equal(valid, positions < lengths[:, None]):
            raise ValueError(
                "batch['attention_mask'] must be right-padded (ones, then zeros) to derive "
                "lengths; pass lengths explicitly otherwise."
            )
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
    padded = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in lengths_list]
    cu_seqlens = torch.tensor([0, *lengths_list]).cumsum(0)
    cu_seqlens_padded = torch.tensor([0, *padded]).cumsum(0)
    rows, cols, dest = (t.to(device) for t in _token_indices(lengths_list, cu_seqlens_padded))
    total = int(cu_seqlens_padded[-1])
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
    packed["cu_seqlens"] = cu_seqlens.to(device=device, dtype=torch.int32)
    packed["cu_seqlens_padded"] = cu_seqlens_padded.to(device=device, dtype=torch.int32)
    packed["max_seqlen"] = max(padded)
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
        packed: ``[1, T, ...]`` (``seq_dim=1``) or ``[T, 1, ...]`` (``seq_dim=0``, logits).
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
    rows, cols, dest = (t.to(flat.device) for t in _token_indices(lengths, boundaries))
    out = flat.new_full((len(lengths), seq_len, *flat.shape[1:]), pad_value)
    out = out.index_put((rows, cols), flat[dest])
    return out.transpose(0, 1) if seq_dim == 0 else out


def position_sequence_normalizers(loss_mask: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`~bert_reduce.normalization.sequence_normalizers` of rows whose positions restart.

    A sequence starts at every ``position_ids == 0`` (how Hugging Face's
    ``DataCollatorWithFlattening`` marks them) and at the first token of every row. No host
    sync.

    Raises:
        ValueError: If ``loss_mask`` and ``position_ids`` are not of one ``[b, s]`` shape.
    """
    if loss_mask.dim() != 2 or position_ids.shape != loss_mask.shape:
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} and loss_mask of shape "
            f"{tuple(loss_mask.shape)} must have the same [b, s] shape."
        )
    sequence_start = position_ids.to(loss_mask.device) == 0
    sequence_start[:, 0] = True
    # Sequence id of every token in row-major order; T ids at most, so index_add's size is
    # static: total weight of sequence k = sum of the weights of the tokens with id k.
    seq_id = sequence_start.reshape(-1).cumsum(0) - 1
    weights = mask_weights(loss_mask).reshape(-1)
    totals = torch.zeros_like(weights).index_add_(0, seq_id, weights)
    return totals[seq_id].view(loss_mask.shape), sequence_start


def batch_sequence_normalizers(
    batch: Mapping[str, Any], loss_mask: Tensor, *, context_parallel_size: int = 1
) -> dict[str, Tensor]:
    """``sequence_weight`` and ``sequence_start`` of a batch, from what it says about sequences.

    The one lookup of every loss path's per-sequence and constant modes, in this order:
    ``batch["sequence_weight"]`` and ``batch["sequence_start"]`` as given (the only way under
    context parallelism); the first of :data:`SEQUENCE_BOUNDARY_KEYS` the batch holds; the
    ``position_ids`` of a ``[1, T]`` row (:func:`position_sequence_normalizers`); else each
    row is one sequence (``{}``).

    Args:
        batch: The micro-batch (or this rank's shard of it).
        loss_mask: Its ``[b, s]`` loss mask (bool, integer or float weights).
        context_parallel_size: How many shards each sequence is split into.

    Returns:
        ``{"sequence_weight": ..., "sequence_start": ...}`` (``[b, s]`` each), or ``{}``.

    Raises:
        KeyError: If only one of ``sequence_weight`` and ``sequence_start`` is present.
        ValueError: Under context parallelism without both; or for a ``[1, T]`` row that
            looks packed (``cu_seq_lens_k``, ``max_length_q``, ...) but holds no boundary key,
            whose sequences would otherwise silently count as one.
    """
    boundaries = next((key for key in SEQUENCE_BOUNDARY_KEYS if key in batch), None)
    if "sequence_weight" in batch or "sequence_start" in batch:
        if "sequence_weight" not in batch or "sequence_start" not in batch:
            raise KeyError(
                "batch must hold both 'sequence_weight' and 'sequence_start' (bert_reduce."
                "normalization.sequence_normalizers on the unsliced batch), or neither; it has "
                f"{sorted(batch)}."
            )
        pair = batch["sequence_weight"], batch["sequence_start"]
    elif context_parallel_size > 1:
        raise ValueError(
            "The per-sequence and constant normalizations under context parallelism need "
            "batch['sequence_weight'] and batch['sequence_start'], computed on the unsliced "
            "batch (bert_reduce.normalization.sequence_normalizers) and sliced with it; the "
            f"batch has {sorted(batch)}."
        )
    elif boundaries is not None:
        pair = sequence_normalizers(loss_mask, batch[boundaries])
    elif loss_mask.size(0) == 1 and "position_ids" in batch:
        pair = position_sequence_normalizers(loss_mask, batch["position_ids"])
    else:
        hints = sorted(k for k in batch if k.startswith(_PACKING_HINT_PREFIXES))
        if loss_mask.size(0) == 1 and hints:
            raise ValueError(
                f"This [1, T] batch looks packed (it has {hints}) but says nowhere where its "
                f"sequences start: add one of {list(SEQUENCE_BOUNDARY_KEYS)} or 'position_ids' "
                "(restarting at 0 with every sequence), or 'sequence_weight' and "
                "'sequence_start'."
            )
        return {}
    return dict(zip(("sequence_weight", "sequence_start"), pair, strict=True))
