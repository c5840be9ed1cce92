"""Megatron-Core language models (the ``megatron`` extra).

* :func:`output_layer_inputs`: the fused masked-only head's inputs of a Megatron-Core
  ``BertModel``-style model (BioNeMo's ESM-2 and Geneformer included): the hidden states
  entering its output layer and that layer's weight and bias, without the logits.
"""

from bert_reduce.megatron.output_layer import output_layer_inputs

__all__ = ["output_layer_inputs"]
