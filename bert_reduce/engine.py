"""The loss options, and the one step from a micro-batch and a model output to the loss's terms.

Every integration calls :func:`loss_terms` (or, for per-token losses, :func:`token_losses`):
:class:`bert_reduce.BERTMLMLossWithReduction` (and :class:`bert_reduce.lightning.ExactMLMModule`,
through its loss instance), :class:`bert_reduce.GlobalBatchLoss`,
:class:`bert_reduce.hf.ExactMLMTrainer` and :meth:`bert_reduce.TokenPerplexity.update_from_logits`.
Each decides only when to reduce the terms, how to scale the gradients and what to log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_reduce import distributed
from bert_reduce._vocab_parallel import Capacity, resolve_capacity
from bert_reduce.cross_entropy import cross_entropy_token_losses, unreduced_token_loss_fn
from bert_reduce.forward_output import (
    HIDDEN_LAYOUT_KEY,
    HIDDEN_STATES_KEY,
    OUTPUT_BIAS_KEY,
    OUTPUT_WEIGHT_KEY,
    Layout,
    as_forward_out,
    check_layout,
    forward_out_key,
)
from bert_reduce.functional import (
    check_same_shape,
    check_token_tensor,
    validate_masked_labels,
)
from bert_reduce.linear_cross_entropy import (
    linear_cross_entropy_loss_sum,
    linear_cross_entropy_token_losses,
)
from bert_reduce.normalization import Normalization, checked_normalization, token_loss_sum
from bert_reduce.num_scored import NUM_SCORED_KEY
from bert_reduce.packing import batch_sequence_normalizers

CrossEntropy = Literal["masked", "megatron", "megatron_fused"]
"""The kernel on logits; see :attr:`LossOptions.cross_entropy`."""
CROSS_ENTROPY: tuple[CrossEntropy, ...] = get_args(CrossEntropy)


@dataclass(frozen=True)
class LossOptions:
    """The loss options every integration takes, under these names; checked once, here.

    Attributes:
        normalization: What the summed loss is divided by: ``"per_token"`` (default),
            ``"per_sequence"`` or ``"constant"`` (``docs/normalization.md``).
        constant_per_sequence: As in :func:`bert_reduce.normalization.token_loss_sum`.
        weight_resolution: As in :func:`bert_reduce.normalization.token_loss_sum`.
        capacity: Which rows the kernels compute when the batch has no ``num_scored``
            (``docs/fast_path.md``); ``None`` (default): each kernel's own default.
        cross_entropy: The kernel: ``"masked"`` (default), ``"megatron"`` (Megatron-Core's
            vocab-parallel cross-entropy) or ``"megatron_fused"`` (its fused kernel, one
            all-reduce fewer under TP): ``docs/megatron.md#cross-entropy-kernels``.
        ignore_index: Label of unscored positions (Hugging Face's ``-100``): such a position
            weighs 0 whatever ``loss_mask`` says. ``None``: only ``loss_mask`` decides (a
            scored out-of-vocabulary label then makes the loss NaN).

    Raises:
        ValueError: On an unknown normalization or kernel (the message lists the valid
            ones), a ``"constant"`` mode without a positive ``constant_per_sequence``, a bad
            ``capacity`` or a non-positive ``weight_resolution``.

    Example:
        >>> LossOptions(normalization="per_sequence").normalization.value
        'per_sequence'
        >>> LossOptions(normalization="per_tokens")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
          ...
        ValueError: 'per_tokens' is not a normalization; choose one of 'per_token', ...
    """

    normalization: Normalization = Normalization.PER_TOKEN
    constant_per_sequence: int | None = None
    weight_resolution: int | None = None
    capacity: Capacity | None = None
    cross_entropy: CrossEntropy = "masked"
    ignore_index: int | None = -100

    def __post_init__(self) -> None:
        normalization = checked_normalization(self.normalization, self.constant_per_sequence)
        object.__setattr__(self, "normalization", normalization)
        if self.cross_entropy not in CROSS_ENTROPY:
            raise ValueError(
                f"cross_entropy must be one of {', '.join(map(repr, CROSS_ENTROPY))}, got "
                f"{self.cross_entropy!r}."
            )
        if self.capacity is not None:
            resolve_capacity(self.capacity, 1)
        if self.weight_resolution is not None and self.weight_resolution <= 0:
            raise ValueError(f"weight_resolution must be positive, got {self.weight_resolution}.")


def scored_weights(batch: Mapping[str, Any], ignore_index: int | None = -100) -> Tensor:
    """The ``[b, s]`` weights of a batch's scored tokens.

    ``loss_mask`` where the batch has one (bool, integer or float weights), else 1; 0 wherever
    the label is ``ignore_index``.

    Raises:
        KeyError: If the batch has no ``labels``, or neither ``loss_mask`` nor an
            ``ignore_index``.
        TypeError: If ``labels`` or ``loss_mask`` is not a tensor.
        ValueError: If ``labels`` is not ``[b, s]`` or ``loss_mask`` has another shape.
    """
    labels = _tensor(batch, "labels", "batch")
    if labels.dim() != 2:
        raise ValueError(f"labels must be [b, s], got shape {tuple(labels.shape)}.")
    if "loss_mask" not in batch:
        if ignore_index is None:
            raise KeyError(
                f"batch has no 'loss_mask' and ignore_index=None: nothing says which tokens "
                f"are scored; it has {sorted(batch)}."
            )
        return labels != ignore_index
    mask = _tensor(batch, "loss_mask", "batch")
    check_same_shape(mask, labels, ("loss_mask", "labels"), "[b, s]")
    if ignore_index is None:
        return mask
    return torch.where(labels != ignore_index, mask, torch.zeros_like(mask))


def _tensor(mapping: Mapping[str, Any], key: str, name: str) -> Tensor:
    if key not in mapping:
        raise KeyError(f"{name} has no {key!r} key; it has {sorted(mapping)}.")
    value = mapping[key]
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(value).__name__}.")
    return value


def _check_labels(labels: Tensor, weights: Tensor, vocab_shard: int) -> None:
    vocab_size = vocab_shard * distributed.tensor_parallel_world_size()
    validate_masked_labels(labels, weights, vocab_size)


def _rows(options: LossOptions, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The kernels' row selection: the batch's ``num_scored``, else ``capacity`` if set."""
    rows: dict[str, Any] = {"num_scored": batch.get(NUM_SCORED_KEY)}
    if options.capacity is not None:
        rows["capacity"] = options.capacity
    return rows


def _hidden_inputs(
    out: Mapping[str, Any], layout: Layout
) -> tuple[Tensor, Tensor, Tensor | None, Layout]:
    hidden = _tensor(out, HIDDEN_STATES_KEY, "forward_out")
    weight = _tensor(out, OUTPUT_WEIGHT_KEY, "forward_out")
    hidden_layout = check_layout(
        out.get(HIDDEN_LAYOUT_KEY, layout), f"forward_out[{HIDDEN_LAYOUT_KEY!r}]"
    )
    return hidden, weight, out.get(OUTPUT_BIAS_KEY), hidden_layout


def token_losses(
    batch: Mapping[str, Any],
    forward_out: Tensor | Mapping[str, Any],
    options: LossOptions,
    *,
    layout: Layout,
    weights: Tensor | None = None,
    key: str | None = None,
    check_labels: bool = False,
) -> Tensor:
    """``[b, s]`` per-token losses of one micro-batch, 0 where unscored.

    The arguments are :func:`loss_terms`' (of ``batch``, only ``labels``, ``loss_mask`` and
    ``num_scored`` are read), and ``weights``, the batch's :func:`scored_weights` if known.

    Returns:
        ``[b, s]`` losses in fp32 (fp64 for fp64 inputs).
    """
    weights = scored_weights(batch, options.ignore_index) if weights is None else weights
    labels = batch["labels"]
    out = as_forward_out(forward_out, check_layout(layout))
    name = forward_out_key(out, key)
    if name == "lm_loss":
        losses = _tensor(out, name, "forward_out")
        check_same_shape(losses, labels, ("forward_out['lm_loss']", "labels"), "[b, s]")
        return losses
    if name == HIDDEN_STATES_KEY:
        hidden, weight, bias, hidden_layout = _hidden_inputs(out, layout)
        vocab_shard = weight.size(0)
    else:
        logits = _tensor(out, name, "forward_out")
        check_token_tensor(logits, labels, name, "bsv" if name == "logits" else "sbv")
        vocab_shard = logits.size(-1)
    if check_labels:
        _check_labels(labels, weights, vocab_shard)
    if options.cross_entropy != "masked":
        if not distributed.megatron_is_initialized():
            raise ValueError(
                f"cross_entropy={options.cross_entropy!r} runs Megatron-Core's vocab-parallel "
                "cross-entropy, which needs Megatron-Core's parallel state "
                "(megatron.core.parallel_state.initialize_model_parallel); outside Megatron "
                "use cross_entropy='masked' (the default)."
            )
        if name == HIDDEN_STATES_KEY:  # Megatron's kernels need every logit
            logits = F.linear(hidden, weight, bias)
        if name == "logits" or (name == HIDDEN_STATES_KEY and hidden_layout == "bs"):
            logits = logits.transpose(0, 1)
        fused = options.cross_entropy == "megatron_fused"
        return unreduced_token_loss_fn(logits, labels, cross_entropy_loss_fusion=fused)
    if name == HIDDEN_STATES_KEY:
        return linear_cross_entropy_token_losses(
            hidden, weight, labels, weights, bias=bias, layout=hidden_layout,
            **_rows(options, batch),
        )  # fmt: skip
    if name == "logits":
        # [b, s, v] is the kernel's [s, b, v] with the roles of b and s swapped: passed as it
        # is (rows read in memory order, the gradient in the logits' own layout), with
        # transposed labels and weights.
        return cross_entropy_token_losses(
            logits, labels.t(), weights.t(), **_rows(options, batch)
        ).t()
    return cross_entropy_token_losses(logits, labels, weights, **_rows(options, batch))


def mode_terms(
    batch: Mapping[str, Any],
    weights: Tensor,
    per_token_loss: Tensor | None,
    options: LossOptions,
    *,
    context_parallel_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """``(numerator, denominator)`` of ``[b, s]`` losses in the options' mode.

    ``per_token_loss=None`` gives the denominator alone (the numerator is then 0): what a
    step's global denominator is summed from before any forward.
    """
    if per_token_loss is None:
        per_token_loss = torch.zeros(weights.shape, dtype=torch.float32, device=weights.device)
    return token_loss_sum(
        per_token_loss, weights, options.normalization,
        **_mode_options(batch, weights, options, context_parallel_size),
    )  # fmt: skip


def _mode_options(
    batch: Mapping[str, Any], weights: Tensor, options: LossOptions, context_parallel_size: int
) -> dict[str, Any]:
    sequences = {}
    if options.normalization is not Normalization.PER_TOKEN:
        sequences = batch_sequence_normalizers(
            batch, weights, context_parallel_size=context_parallel_size
        )
    return {
        **sequences,
        "constant_per_sequence": options.constant_per_sequence,
        "weight_resolution": options.weight_resolution,
    }


def loss_terms(
    batch: Mapping[str, Any],
    forward_out: Tensor | Mapping[str, Any],
    options: LossOptions,
    *,
    layout: Layout,
    key: str | None = None,
    context_parallel_size: int = 1,
    check_labels: bool = False,
) -> tuple[Tensor, Tensor]:
    """One micro-batch's ``(numerator, denominator)`` in the options' mode; no collective.

    On hidden states with the ``"masked"`` kernel this is the fused head's
    :func:`bert_reduce.linear_cross_entropy_loss_sum`; otherwise :func:`token_losses`
    followed by :func:`bert_reduce.normalization.token_loss_sum`.

    Args:
        batch: ``labels`` (``[b, s]`` integer token ids), optionally ``loss_mask``
            (``[b, s]`` bool, integer or float weights), ``num_scored``, and what the mode
            needs to find sequences (:func:`bert_reduce.packing.batch_sequence_normalizers`).
        forward_out: The model output (:mod:`bert_reduce.forward_output`), or a bare logits
            tensor in ``layout``.
        options: The loss options.
        layout: The layout of a bare tensor, and of hidden states without ``hidden_layout``.
        key: Which entry of ``forward_out`` to score (``None``: the one present).
        context_parallel_size: How many shards each sequence is split into.
        check_labels: Raise on a scored label outside the vocabulary or a negative weight
            (reads them on the host: a sync).

    Returns:
        The 0-dim numerator (carrying the gradient) and denominator, as
        :func:`bert_reduce.normalization.token_loss_sum` returns them.

    Raises:
        KeyError: On a missing key (the message names it and lists those present), or
            several candidate outputs and no ``key``.
        TypeError: On a ``forward_out`` that is neither a tensor nor a mapping.
        ValueError: On mismatched shapes or devices, a bad layout, a Megatron kernel without
            Megatron-Core's parallel state, or (``check_labels``) invalid labels.

    Example:
        >>> logits = torch.zeros(1, 3, 4)  # [b, s, v]
        >>> batch = {"labels": torch.tensor([[1, -100, 2]])}
        >>> loss_terms(batch, logits, LossOptions(), layout="bs")
        (tensor(2.7726), tensor(2))
    """
    weights = scored_weights(batch, options.ignore_index)
    out = as_forward_out(forward_out, check_layout(layout))
    if forward_out_key(out, key) == HIDDEN_STATES_KEY and options.cross_entropy == "masked":
        hidden, weight, bias, hidden_layout = _hidden_inputs(out, layout)
        labels = batch["labels"]
        if check_labels:
            _check_labels(labels, weights, weight.size(0))
        return linear_cross_entropy_loss_sum(
            hidden, weight, labels, weights, options.normalization, bias=bias,
            layout=hidden_layout, **_rows(options, batch),
            **_mode_options(batch, weights, options, context_parallel_size),
        )  # fmt: skip
    losses = token_losses(
        batch, out, options, layout=layout, weights=weights, key=key, check_labels=check_labels
    )
    return mode_terms(batch, weights, losses, options, context_parallel_size=context_parallel_size)
