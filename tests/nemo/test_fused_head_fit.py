"""A real NeMo 2 fit with the masked-only fused head equals the logits path.

Megatron-Core's ``BertModel`` (output weight tied to the word embeddings) hands the loss its
output layer's inputs (:func:`bert_reduce.megatron.output_layer_inputs`) in training, and each
micro-batch's count of scored positions as an ``int`` (:func:`bert_reduce.nemo.
num_scored_data_step`, checked in the module's ``forward_step``); ``tests.helpers.nemo_bert.fit``:
DP = 2 equals one-process PyTorch on whole global batches (fp32 tolerances); TP = 2
(vocab-sharded output layer) equals the same fit through the logits.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import torch

from tests.helpers.nemo_bert import assert_matches_reference, fit, reference_training

pytestmark = pytest.mark.slow


def test_data_parallel_fused_head_fit_equals_pytorch_on_whole_global_batches() -> None:
    results = fit(world_size=2, output="fused")
    assert [r["dp_rank"] for r in results] == [0, 1]
    assert_matches_reference(results, reference_training())


def test_tensor_parallel_fused_head_fit_equals_the_logits_fit() -> None:
    fused, logits = fit(world_size=2, tp=2, output="fused"), fit(world_size=2, tp=2)
    for fused_rank, logits_rank in zip(fused, logits, strict=True):
        assert fused_rank["dp_rank"] == 0  # TP = 2 on 2 ranks: no data parallelism
        assert_matches_reference([fused_rank], (logits_rank["losses"], logits_rank["params"]))
    # The vocab shards differ between the ranks: this is tensor parallelism.
    weights = [r["params"]["embedding.word_embeddings.weight"] for r in fused]
    assert weights[0].shape[0] == 16 and not torch.equal(weights[0], weights[1])
