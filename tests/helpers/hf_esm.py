"""A tiny Hugging Face ``EsmForMaskedLM`` configuration, and an ESM-like batch, for CPU tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

PAD_ID, MASK_ID, VOCAB = 1, 32, 33
# The sizes of the tiny Hugging Face models (ESM here, BERT in tests/helpers/hf_trainer.py).
TINY_SIZES = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def tiny_esm_config(**overrides: Any):
    """An ESM-2-shaped config (rotary, pre-LN, tied head) small enough for CPU tests."""
    from transformers import EsmConfig

    values: dict[str, Any] = {
        "vocab_size": VOCAB,
        **TINY_SIZES,
        "position_embedding_type": "rotary",
        "pad_token_id": PAD_ID,
        "mask_token_id": MASK_ID,
        "token_dropout": True,
        "emb_layer_norm_before": False,
    }
    values.update(overrides)
    return EsmConfig(**values)


def esm_batch(
    lengths: list[int], seq_len: int, masked_per_row: list[int], seed: int = 0
) -> dict[str, Tensor]:
    """Right-padded ``[b, s]`` protein-like rows: ``input_ids``, ``attention_mask``, ``labels``.

    Row ``i`` has ``masked_per_row[i]`` of its first ``lengths[i]`` tokens replaced by the mask
    token and labelled; every other label is -100.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    tokens = torch.randint(4, 24, (rows, seq_len), generator=gen)
    real = torch.arange(seq_len) < torch.tensor(lengths)[:, None]
    masked = torch.zeros(rows, seq_len, dtype=torch.bool)
    for row, (length, count) in enumerate(zip(lengths, masked_per_row, strict=True)):
        masked[row, torch.randperm(length, generator=gen)[:count]] = True
    return {
        "input_ids": torch.where(masked, MASK_ID, torch.where(real, tokens, PAD_ID)),
        "attention_mask": real.long(),
        "labels": torch.where(masked, tokens, -100),
    }
