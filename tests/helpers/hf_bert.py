"""A tiny Hugging Face ``BertForMaskedLM`` config (Geneformer's architecture) for CPU tests."""

from __future__ import annotations

from typing import Any


def tiny_bert_config(**overrides: Any):
    """A BERT masked-LM config (post-LN, tied head with bias) small enough for CPU tests."""
    from transformers import BertConfig

    values: dict[str, Any] = {
        "vocab_size": 40,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    values.update(overrides)
    return BertConfig(**values)
