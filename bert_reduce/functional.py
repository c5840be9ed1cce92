"""The maths of masked-token losses, in plain torch.

Nothing here knows about Lightning, NeMo or Hydra. Megatron-Core is imported lazily, and only
when its parallel state is initialized, so this module stays importable (and fast to import)
everywhere.

Layouts follow Megatron: logits are ``[s, b, v]`` (sequence first, vocab possibly sharded over
tensor-parallel ranks), while labels, masks and per-token losses are ``[b, s]``.

Every micro-batch reduces to ``(loss_sum, num_tokens)``. Sums are exact to add across
micro-batches and ranks; dividing once by the global count gives the exact mean:

    loss = sum_over_everything(loss_sum) / sum_over_everything(num_tokens)
"""

from __future__ import annotations

import torch
from torch import Tensor

from bert_reduce import distributed

__all__ = [
    "accumulation_dtype",
    "check_logits_and_labels",
    "check_same_shape",
    "masked_token_loss",
    "masked_weighted_sum",
    "safe_divide",
    "unreduced_token_loss_fn",
    "validate_masked_labels",
]


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
    """Raise ``ValueError`` naming both tensors and shapes unless the shapes are equal.

    Args:
        first: A tensor.
        second: The tensor whose shape must equal ``first``'s.
        names: How the error message calls the two tensors.
        layout: The expected layout, e.g. ``"[b, s]"``, quoted in the message.

    Raises:
        ValueError: When the shapes differ.
    """
    if first.shape != second.shape:
        expected = f"the same {layout} shape" if layout else "the same shape"
        raise ValueError(
            f"{names[0]} of shape {tuple(first.shape)} and {names[1]} of shape "
            f"{tuple(second.shape)} must have {expected}."
        )


def check_logits_and_labels(logits: Tensor, labels: Tensor) -> None:
    """Raise ``ValueError`` unless logits are ``[s, b, v]`` and labels ``[b, s]``.

    Only shapes are read, so this never synchronizes with the device.
    """
    if logits.dim() != 3:
        raise ValueError(
            f"Expected token_logits of shape [s, b, v], got {tuple(logits.shape)} "
            f"({logits.dim()} dims)."
        )
    if labels.dim() != 2:
        raise ValueError(
            f"Expected labels of shape [b, s], got {tuple(labels.shape)} ({labels.dim()} dims)."
        )
    seq_len, batch_size, _ = logits.shape
    if tuple(labels.shape) != (batch_size, seq_len):
        raise ValueError(
            f"token_logits of shape {tuple(logits.shape)} ([s, b, v]) and labels of shape "
            f"{tuple(labels.shape)} ([b, s]) do not match: expected labels of shape "
            f"{(batch_size, seq_len)}."
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}.")


def unreduced_token_loss_fn(
    logits: Tensor, labels: Tensor, cross_entropy_loss_fusion: bool = False
) -> Tensor:
    """Per-token cross-entropy, without any mask applied.

    Unlike BioNeMo's function of the same name, the caller's ``logits`` are never modified:
    Megatron-Core's kernels subtract the max and exponentiate in place, so they work on a copy.

    A label outside ``[0, vocab)`` (``vocab`` being the full, unsharded vocabulary) gives a NaN
    loss at its position. Unmasked positions are dropped by :func:`masked_token_loss` without
    arithmetic, so padding labels such as ``-100`` are harmless there, while an invalid label
    on a masked position makes the loss NaN instead of silently wrong.

    Args:
        logits: ``[s, b, v]`` logits; under tensor parallelism ``v`` is this rank's vocab shard.
            Any float dtype; the maths runs in fp32 (fp64 when ``logits`` are fp64 and no
            Megatron parallel state is initialized).
        labels: ``[b, s]`` integer token ids.
        cross_entropy_loss_fusion: Use Megatron-Core's fused vocab-parallel cross-entropy (one
            all-reduce instead of two for the sums under TP). Its gradient is computed in bf16,
            whatever the logits' dtype. Needs Megatron's parallel state.

    Returns:
        ``[b, s]`` per-token losses in the accumulation dtype (fp32, or fp64).

    Raises:
        ValueError: On mismatched shapes, or when the fused kernel is asked for without an
            initialized Megatron parallel state.
    """
    check_logits_and_labels(logits, labels)
    labels_sb = labels.transpose(0, 1)
    tp_size = distributed.tensor_parallel_world_size()
    vocab_size = logits.size(-1) * tp_size

    if distributed.megatron_is_initialized():
        # Megatron works in fp32 in place: hand it a private fp32 copy.
        work = logits.to(torch.float32, copy=True)
        target = labels_sb.contiguous()
        if cross_entropy_loss_fusion:
            from megatron.core.fusions.fused_cross_entropy import (
                fused_vocab_parallel_cross_entropy,
            )

            loss_sb = fused_vocab_parallel_cross_entropy(
                work, target, distributed.tensor_parallel_group()
            )
        else:
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            loss_sb = vocab_parallel_cross_entropy(work, target)
    else:
        if cross_entropy_loss_fusion:
            raise ValueError(
                "cross_entropy_loss_fusion=True needs Megatron-Core's parallel state "
                "(megatron.core.parallel_state.initialize_model_parallel)."
            )
        # Without Megatron's parallel state there is no vocab sharding (TP = 1), and the
        # vocab-parallel cross-entropy reduces to a log-softmax over the whole vocabulary.
        log_probs = torch.log_softmax(logits.to(accumulation_dtype(logits.dtype)), dim=-1)
        safe_target = labels_sb.clamp(0, vocab_size - 1).unsqueeze(-1)
        loss_sb = -log_probs.gather(-1, safe_target).squeeze(-1)

    in_vocab = (labels_sb >= 0) & (labels_sb < vocab_size)
    loss_sb = torch.where(in_vocab, loss_sb, torch.nan)
    return loss_sb.transpose(0, 1).contiguous()


def masked_token_loss(per_token_loss: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of the per-token losses over the masked positions, and how many there are.

    ``loss_mask`` may be boolean, integer or float. A float mask weights each token's loss
    (``loss_sum = sum(mask * loss)``) while ``num_tokens`` still counts the positions whose
    weight is non-zero.

    Args:
        per_token_loss: ``[b, s]`` per-token losses (any float dtype).
        loss_mask: ``[b, s]``; non-zero where the token is scored.

    Returns:
        ``(loss_sum, num_tokens)``: a 0-dim sum in fp32 (fp64 for fp64 input) that carries
        gradients, and a 0-dim int64 count, exact past 2**24 tokens. With an empty mask both are
        0 and so is the gradient.

    Raises:
        ValueError: When the two shapes differ.
    """
    check_same_shape(per_token_loss, loss_mask, ("per_token_loss", "loss_mask"), "[b, s]")
    scored = loss_mask != 0
    weights = loss_mask.to(accumulation_dtype(per_token_loss.dtype))
    return masked_weighted_sum(per_token_loss, weights, scored), scored.sum(dtype=torch.int64)


def masked_weighted_sum(per_token_loss: Tensor, weights: Tensor, scored: Tensor) -> Tensor:
    """``sum(weights * per_token_loss)`` over the ``scored`` positions, in ``weights``' dtype.

    Args:
        per_token_loss: ``[b, s]`` per-token losses.
        weights: ``[b, s]`` float weights; their dtype is the accumulation dtype.
        scored: ``[b, s]`` bool; only these positions reach the sum and the gradient.

    Returns:
        The 0-dim weighted sum, carrying gradients.
    """
    # `where` rather than a product: a NaN or inf loss on an unscored position (padding
    # labels, say) must not leak into the sum, nor into the gradient.
    return torch.where(scored, per_token_loss.to(weights.dtype) * weights, 0).sum()


def validate_masked_labels(labels: Tensor, loss_mask: Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` if a scored label lies outside ``[0, vocab_size)``.

    This reads device values back to the host, so it synchronizes; it is the opt-in check
    behind ``BERTMLMLossWithReduction(check_labels=True)``.

    Args:
        labels: ``[b, s]`` integer token ids.
        loss_mask: ``[b, s]``; non-zero where the token is scored.
        vocab_size: Size of the full (unsharded) vocabulary.

    Raises:
        ValueError: Naming how many scored labels are invalid and the first offending one.
    """
    check_same_shape(labels, loss_mask, ("labels", "loss_mask"), "[b, s]")
    bad = (loss_mask != 0) & ((labels < 0) | (labels >= vocab_size))
    num_bad = int(bad.sum())
    if num_bad:
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{num_bad} masked label(s) outside [0, {vocab_size}); first at [b={row}, s={col}]: "
            f"{int(labels[row, col])}."
        )
