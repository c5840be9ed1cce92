"""The fused head's inputs from a Megatron-Core language model, without its ``[s, b, v]`` logits.

What it returns, and under tensor, sequence and pipeline parallelism: ``docs/megatron.md``,
"The masked-only head on a Megatron-Core model".
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from bert_reduce._vocab_parallel import gather_sequence_parallel
from bert_reduce.forward_output import (
    HIDDEN_LAYOUT_KEY,
    HIDDEN_STATES_KEY,
    OUTPUT_BIAS_KEY,
    OUTPUT_WEIGHT_KEY,
    shadowed_forward,
)


def _language_model(model: nn.Module) -> nn.Module:
    """The model inside its ``.module`` wrappers: owns ``output_layer``, or is an earlier stage."""
    inner = model
    while not hasattr(inner, "output_layer") and getattr(inner, "post_process", True):
        wrapped = getattr(inner, "module", None)
        if not isinstance(wrapped, nn.Module):
            raise TypeError(
                f"output_layer_inputs needs a Megatron-Core language model with an "
                f"`output_layer` (Megatron-Core's BertModel, BioNeMo's MegatronBioBertModel), or a "
                f"wrapper holding one in `.module`; got {type(model).__name__}."
            )
        inner = wrapped
    return inner


def _tensor_parallel_input(layer: nn.Module, hidden: Tensor) -> Tensor:
    """``hidden`` through the mapping ``ColumnParallelLinear.forward`` applies to its input."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    group = getattr(layer, "tp_group", None)
    if layer.sequence_parallel:
        # [s/tp, b, h] -> [s, b, h]; backward: reduce-scatter of the vocab shards' gradients.
        return gather_sequence_parallel(hidden, group)
    if getattr(layer, "disable_grad_reduce", False):
        return hidden
    # Identity forward; backward: all-reduce of the vocab shards' partial gradients.
    return copy_to_tensor_model_parallel_region(hidden, group=group)


def output_layer_inputs(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)`` with the output layer stopped: the fused head's ``forward_out``.

    For training; where logits are wanted, call the model itself (``docs/megatron.md``).

    Args:
        model: A Megatron-Core ``BertModel``-style language model whose forward ends in
            ``self.output_layer(hidden, weight=...)`` (those ``docs/megatron.md`` lists), or a
            wrapper holding one in ``.module``.
        *args: The model's positional inputs (``input_ids``, ``attention_mask``, ...).
        **kwargs: Its keyword inputs, without ``lm_labels`` (the loss reads the batch's labels).

    Returns:
        ``{"hidden_states": [s, b, h], "hidden_layout": "sb", "output_weight": [v/tp, h],
        "output_bias": [v/tp] or None}`` on the last pipeline stage (with sequence
        parallelism the hidden states are whole, ``[s, b, h]``), else (``post_process=False``)
        the model's own output, unchanged.

    Raises:
        TypeError: If no ``output_layer`` is found on the model or inside its wrappers.
        ValueError: If labels are passed, or with ``defer_embedding_wgrad_compute``, whose
            deferred weight gradient needs the output layer's own forward.
    """
    if kwargs.get("lm_labels") is not None:
        raise ValueError(
            "output_layer_inputs takes the model's inputs without lm_labels: the model would "
            "compute a loss from the stopped output layer. Give the labels to the loss instead."
        )
    inner = _language_model(model)
    if not hasattr(inner, "output_layer"):  # a pipeline stage before the last
        return model(*args, **kwargs)
    layer = inner.output_layer
    if getattr(getattr(layer, "config", None), "defer_embedding_wgrad_compute", False):
        raise ValueError(
            "output_layer_inputs does not support defer_embedding_wgrad_compute=True: the "
            "deferred weight gradient is computed from the output layer's own forward."
        )
    seen: dict[str, Any] = {}

    def forward(input_: Tensor, weight: Tensor | None = None, **_: Any) -> tuple:
        # Records the layer's inputs; the empty [s, b, 0] logits let the rest of the model's
        # forward run unchanged (Megatron's BertModel transposes them, BioNeMo's puts them in
        # its output dict).
        seen[HIDDEN_STATES_KEY] = _tensor_parallel_input(layer, input_)
        seen[OUTPUT_WEIGHT_KEY] = layer.weight if weight is None else weight
        # With skip_bias_add the layer returns the bias for the caller, and Megatron's BERT
        # and BioNeMo's drop it: their logits carry no bias.
        seen[OUTPUT_BIAS_KEY] = None if layer.skip_bias_add else layer.bias
        return input_.new_empty(*input_.shape[:-1], 0), None

    with shadowed_forward(layer, forward):
        model(*args, **kwargs)
    if not seen:
        raise TypeError(
            f"{type(inner).__name__}.forward did not call its output_layer; "
            "output_layer_inputs needs a model that does (on the last pipeline stage)."
        )
    return {HIDDEN_LAYOUT_KEY: "sb", **seen}
