"""The fused head's inputs from a Hugging Face masked LM, without its ``[b, s, v]`` logits.

Use: ``docs/pytorch_loop.md``, "The masked-only head: hidden states instead of logits".
Needs ``transformers`` (the ``hf`` extra).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from bert_reduce.forward_output import (
    HIDDEN_LAYOUT_KEY,
    HIDDEN_STATES_KEY,
    OUTPUT_BIAS_KEY,
    OUTPUT_WEIGHT_KEY,
    shadowed_forward,
)


def _prediction_head(model: nn.Module) -> tuple[nn.Module, Callable[[Tensor], Tensor], nn.Module]:
    """``(head module, its forward up to the decoder, its decoder)`` of a supported masked LM.

    ``tests/hf/test_lm_head.py`` checks the transform against the model's own logits.
    """
    from transformers import BertForMaskedLM, EsmForMaskedLM

    if isinstance(model, EsmForMaskedLM):
        from transformers.models.esm.modeling_esm import gelu

        head = model.lm_head
        # EsmLMHead.forward: decoder(layer_norm(gelu(dense(x)))) + bias.
        return head, lambda x: head.layer_norm(gelu(head.dense(x))), head.decoder
    if isinstance(model, BertForMaskedLM):
        # BertOnlyMLMHead -> BertLMPredictionHead: decoder(transform(x)), the decoder's bias
        # tied to predictions.bias.
        predictions = model.cls.predictions
        return model.cls, predictions.transform, predictions.decoder
    raise TypeError(
        f"lm_head_inputs supports transformers' EsmForMaskedLM and BertForMaskedLM (optionally "
        f"inside DistributedDataParallel or fully_shard), got {type(model).__name__}."
    )


def lm_head_inputs(model: nn.Module, **inputs: Any) -> dict[str, Any]:
    """``{hidden_states [b, s, h], output_weight [v, h], output_bias [v]}`` of a masked LM.

    Runs ``model(**inputs)`` with the prediction head stopped before its decoder, so the
    ``[b, s, v]`` logits are never computed: ``F.linear(hidden_states, output_weight,
    output_bias)`` equals the model's ``logits``.

    Args:
        model: A ``transformers`` ``EsmForMaskedLM`` or ``BertForMaskedLM``, optionally inside
            ``DistributedDataParallel`` or sharded with ``fully_shard``.
        **inputs: The model's inputs (``input_ids``, ``attention_mask``, ``position_ids``, ...).

    Returns:
        The fused head's ``forward_out``: ``hidden_states`` (``[b, s, h]``, after the head's
        transform), ``hidden_layout`` (``"bs"``), ``output_weight`` and ``output_bias``.

    Raises:
        TypeError: For another model class.
        ValueError: If ``inputs`` holds ``labels``, or when the output layer is in an FSDP2
            unit of its own.
    """
    if "labels" in inputs:
        raise ValueError(
            "lm_head_inputs takes the model's inputs without 'labels': the model would score "
            "its hidden states as logits. Give the labels to the loss instead."
        )
    # The loss reads the output layer's parameters after the forward: under DDP with
    # find_unused_parameters=True (Trainer's default) the hidden states keep them in the
    # forward's graph through an exact zero, else DDP's backward fails ("marked as ready twice").
    keep_decoder_in_graph = isinstance(model, DistributedDataParallel) and (
        model.find_unused_parameters
    )
    inner = model
    while isinstance(inner, DistributedDataParallel):
        inner = inner.module
    head, transform, decoder = _prediction_head(inner)
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 frees a unit's gathered parameters after its forward, before the loss reads them.
    for name, module in inner.named_modules():
        if module is not inner and isinstance(module, FSDPModule):
            if any(part is decoder for part in module.modules()):
                raise ValueError(
                    f"lm_head_inputs reads the output layer's weight after the forward of the "
                    f"fully_shard unit {name!r}, which FSDP2 reshards (frees) right after it. "
                    "Leave the prediction head in the root unit: fully_shard the transformer "
                    "layers and then the whole model."
                )
    seen: dict[str, Tensor | None] = {}

    def forward(features: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        # head(x) returns transform(x). The decoder's parameters are read here, inside the
        # forward, where FSDP2 has them unsharded. ESM's decoder has no bias; its head adds
        # its own `bias` parameter after the decoder.
        bias = decoder.bias if decoder.bias is not None else getattr(head, "bias", None)
        weight = seen[OUTPUT_WEIGHT_KEY] = decoder.weight
        seen[OUTPUT_BIAS_KEY] = bias
        hidden = transform(features)
        if keep_decoder_in_graph:
            anchor = weight[:1, :1].sum() + (0 if bias is None else bias[:1].sum())
            hidden = hidden + anchor * 0
        return hidden

    with shadowed_forward(head, forward):
        hidden = model(**inputs).logits
    return {HIDDEN_STATES_KEY: hidden, HIDDEN_LAYOUT_KEY: "bs", **seen}
