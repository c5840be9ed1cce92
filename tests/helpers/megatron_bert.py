"""A tiny Megatron-Core ``BertModel`` (local layer spec: it runs on CPU) and a batch for it.

Weights are drawn per parameter from a generator seeded by its global name (layers numbered
over all pipeline stages) and sliced to this tensor-parallel rank's shard, so every TP and PP
size holds the same model. Needs Megatron's parallel state
(``tests.helpers.megatron_cpu.single_process_megatron`` or ``run_distributed``).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import Tensor, nn

VOCAB, SEQ_LEN, HIDDEN, MASK_ID = 32, 8, 16, 3
CONFIG: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": HIDDEN,
    "num_attention_heads": 2,
    "ffn_hidden_size": 32,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "use_cpu_initialization": True,
}


def tiny_bert(dtype: torch.dtype = torch.float64, post_process: bool = True, **config: Any):
    """:data:`CONFIG` in ``dtype``; ``post_process=False``: a stage without the output layer."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    fields = {**CONFIG, "params_dtype": dtype, "tensor_model_parallel_size": tp_size, **config}
    return build_bert(TransformerConfig(**fields), SEQ_LEN, post_process)


def build_bert(config, seq_len: int, post_process: bool | None = None):
    """This stage's part of the BERT: tied embeddings, the output layer with a bias.

    The last stage's copy of the tied output weight is drawn as the word embedding.
    """
    from megatron.core import parallel_state
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = BertModel(
        config=config,
        num_tokentypes=0,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=seq_len,
        add_binary_head=False,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=post_process,
        share_embeddings_and_output_weights=True,
    ).to(config.params_dtype)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in global_named_parameters(model).items():
            sharded = tp_size > 1 and getattr(param, "tensor_model_parallel", False)
            shape = list(param.shape)
            if sharded:
                shape[param.partition_dim] *= tp_size
            tied = name == "output_layer.weight"
            seed = zlib.crc32(("embedding.word_embeddings.weight" if tied else name).encode())
            gen = torch.Generator().manual_seed(seed)
            value = 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
            if sharded:
                value = value.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            param.copy_(value)
    return model


def global_named_parameters(model) -> dict[str, nn.Parameter]:
    """Parameters by name, with ``encoder.layers.<i>`` numbered over all pipeline stages."""
    offset = model.encoder.layers[0].layer_number - 1 if model.encoder.layers else 0
    named = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["encoder", "layers"]:
            parts[2] = str(int(parts[2]) + offset)
        named[".".join(parts)] = param
    return named


def mlm_batch(
    batch_size: int = 3,
    seed: int = 0,
    seq_len: int = SEQ_LEN,
    mask_prob: float = 0.4,
    empty_rows: tuple[int, ...] | list[int] = (1,),
) -> dict[str, Tensor]:
    """``text``, ``attention_mask``, ``labels`` and ``loss_mask`` (``[b, s]``)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(MASK_ID + 1, VOCAB, (batch_size, seq_len), generator=gen)
    loss_mask = torch.rand(batch_size, seq_len, generator=gen) < mask_prob
    loss_mask[list(empty_rows)] = False
    return {
        "text": torch.where(loss_mask, MASK_ID, tokens),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "labels": tokens,
        "loss_mask": loss_mask,
    }
