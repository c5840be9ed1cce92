"""The shared input checks, exact weights and the one per-token denominator, in plain torch.

Every micro-batch reduces to ``(loss_sum, denominator)``; sums over micro-batches and ranks,
divided once, give the exact mean (``docs/guarantees.md``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype losses are summed in: fp32, or fp64 when the input already is fp64."""
    return torch.promote_types(dtype, torch.float32)


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, and 0 where ``denominator == 0``; no host sync.

    An empty mask means "no token contributes": its mean is defined as 0, never NaN, and the
    gradient through it is 0 as well (``where`` routes no gradient to the unused branch).
    """
    denominator = denominator.to(numerator.dtype)
    nonzero = denominator != 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, 1), 0)


def check_same_shape(
    first: Tensor, second: Tensor, names: tuple[str, str], layout: str = ""
) -> None:
    """``ValueError`` naming both tensors, their shapes and ``layout`` unless shapes match."""
    if first.shape != second.shape:
        expected = f"the same {layout} shape" if layout else "the same shape"
        raise ValueError(
            f"{names[0]} of shape {tuple(first.shape)} and {names[1]} of shape "
            f"{tuple(second.shape)} must have {expected}."
        )


def check_same_device(first: Tensor, second: Tensor, names: tuple[str, str]) -> None:
    """``ValueError`` naming both tensors and devices unless they share a device."""
    if first.device != second.device:
        raise ValueError(
            f"{names[0]} is on {first.device} and {names[1]} on {second.device}: move them to "
            f"one device (e.g. {names[1]}.to({names[0]}.device))."
        )


def check_token_tensor(
    tensor: Tensor, labels: Tensor, name: str, dims: str, shards: int = 1, note: str = ""
) -> None:
    """``ValueError`` unless labels are ``[b, s]`` integers, matched by ``tensor`` on their device.

    ``tensor`` (named ``name``) must be ``[s / shards, b, x]`` (``dims="sbx"``) or
    ``[b, s, x]`` (``"bsx"``); ``note`` ends the shape error's message.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [b, s], got shape {tuple(labels.shape)}.")
    batch_size, seq_len = labels.shape
    expected = (seq_len // shards, batch_size) if dims[0] == "s" else (batch_size, seq_len)
    if tensor.dim() != 3 or tuple(tensor.shape[:2]) != expected:
        raise ValueError(
            f"{name} of shape {tuple(tensor.shape)} must be [{', '.join(dims)}] = "
            f"[{expected[0]}, {expected[1]}, {dims[2]}] for labels of shape "
            f"{tuple(labels.shape)} ([b, s]){note}."
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}.")
    check_same_device(tensor, labels, (name, "labels"))


def mask_weights(loss_mask: Tensor) -> Tensor:
    """The loss mask as exact weights: int64 for bool/integer masks, fp64 for float ones."""
    if loss_mask.dtype.is_floating_point:
        return loss_mask.to(torch.float64)
    return loss_mask.to(torch.int64)


def token_denominator(loss_mask: Tensor) -> Tensor:
    """The per-token denominator of a loss mask: the sum of its weights, exactly; no host sync.

    The library's one definition of "how many tokens" (``docs/normalization.md``).

    Args:
        loss_mask: ``[b, s]`` (or any shape) bool, integer or float weights.

    Returns:
        A 0-dim int64 sum for bool/integer masks (exact at any size), fp64 for float masks.

    Example:
        >>> token_denominator(torch.tensor([[True, False, True]]))
        tensor(2)
    """
    return mask_weights(loss_mask).sum()


def validate_masked_labels(labels: Tensor, loss_mask: Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` if a scored label lies outside ``[0, vocab_size)`` or a weight is < 0.

    This reads device values back to the host, so it synchronizes; it is the opt-in check
    behind ``BERTMLMLossWithReduction(check_labels=True)``.

    Args:
        labels: ``[b, s]`` integer token ids.
        loss_mask: ``[b, s]``; non-zero where the token is scored.
        vocab_size: Size of the full (unsharded) vocabulary.

    Raises:
        ValueError: Naming how many scored labels (or negative weights) are invalid and the
            first offending one.
    """
    check_same_shape(labels, loss_mask, ("labels", "loss_mask"), "[b, s]")
    if loss_mask.dtype != torch.bool:
        negative = loss_mask < 0
        num_negative = int(negative.sum())
        if num_negative:
            row, col = (int(i) for i in negative.nonzero()[0])
            raise ValueError(
                f"loss_mask holds {num_negative} negative weight(s); first at [b={row}, "
                f"s={col}]: {loss_mask[row, col].item()}. Weights count how often a token is "
                "scored and must be >= 0."
            )
    bad = (loss_mask != 0) & ((labels < 0) | (labels >= vocab_size))
    num_bad = int(bad.sum())
    if num_bad:
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{num_bad} masked label(s) outside [0, {vocab_size}); first at [b={row}, s={col}]: "
            f"{int(labels[row, col])}."
        )
