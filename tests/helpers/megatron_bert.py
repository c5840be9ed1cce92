"""A tiny Megatron-Core ``BertModel`` (local layer spec: it runs on CPU) and a batch for it.

Weights are drawn per parameter from a generator seeded by its name and sliced to this
tensor-parallel rank's shard, so every TP size holds the same model. Needs Megatron's parallel
state (``tests.helpers.megatron_cpu.single_process_megatron`` or ``run_distributed``).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import Tensor

VOCAB, SEQ_LEN, HIDDEN, MASK_ID = 32, 8, 16, 3


def tiny_bert(dtype: torch.dtype = torch.float64, post_process: bool = True, **config: Any):
    """Two layers, no dropout, tied input/output embeddings, the output layer with a bias.

    ``post_process=False`` builds a pipeline stage without the output layer.
    """
    from megatron.core import parallel_state
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = {
        "num_layers": 2,
        "hidden_size": HIDDEN,
        "num_attention_heads": 2,
        "ffn_hidden_size": 32,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": True,
        "params_dtype": dtype,
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
    }
    fields.update(config)
    model = BertModel(
        config=TransformerConfig(**fields),
        num_tokentypes=0,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ_LEN,
        add_binary_head=False,
        post_process=post_process,
        share_embeddings_and_output_weights=True,
    ).to(dtype)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = _full_shape(model, name, param, tp_size)
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            value = 0.3 * torch.randn(full, generator=gen, dtype=torch.float64)
            dim = getattr(param, "partition_dim", -1) if tp_size > 1 else -1
            if getattr(param, "tensor_model_parallel", False) and dim >= 0:
                value = value.chunk(tp_size, dim=dim)[tp_rank]
            param.copy_(value)
    return model


def _full_shape(model, name: str, param: Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def mlm_batch(batch_size: int = 3, seed: int = 0) -> dict[str, Tensor]:
    """``text``, ``attention_mask``, ``labels`` and ``loss_mask`` (``[b, s]``); row 1 empty."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(MASK_ID + 1, VOCAB, (batch_size, SEQ_LEN), generator=gen)
    loss_mask = torch.rand(batch_size, SEQ_LEN, generator=gen) < 0.4
    loss_mask[1] = False
    return {
        "text": torch.where(loss_mask, MASK_ID, tokens),
        "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long),
        "labels": tokens,
        "loss_mask": loss_mask,
    }
