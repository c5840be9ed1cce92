"""Megatron-Core language models (the ``megatron`` extra): :func:`output_layer_inputs`."""

from bert_reduce.megatron.output_layer import output_layer_inputs

__all__ = ["output_layer_inputs"]
