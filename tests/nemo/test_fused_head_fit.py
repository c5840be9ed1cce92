"""A real NeMo 2 fit with the masked-only fused head equals the logits path.

Megatron-Core's ``BertModel`` (output weight tied to the word embeddings) hands the loss its
output layer's inputs (:func:`bert_reduce.megatron.output_layer_inputs`) in training, and each
micro-batch's count of scored positions as an ``int`` (:func:`bert_reduce.nemo.
num_scored_data_step`, checked in the module's ``forward_step``). ``nl.Trainer`` +
``MegatronStrategy`` + Megatron's SGD with clipping, 3 steps, on CPU/gloo
(:mod:`tests.nemo.cpu_stand_ins`):

* DP = 2: every parameter and the loss NeMo logged at every step equal one process of plain
  PyTorch back-propagating ``F.cross_entropy`` over the logits of whole global batches
  (fp32 tolerances, as ``tests/nemo/test_fit.py``);
* TP = 2 (vocab-sharded output layer): every rank's parameters and losses equal those of the
  same fit through the logits.

Runs only where NeMo 2 is installed (``.venv-nemo``, see the ``nemo`` extra).
"""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import torch

from tests.helpers.megatron_cpu import single_process_megatron
from tests.nemo.cpu_stand_ins import megatron_on_cpu
from tests.nemo.fit_helpers import fit
from tests.nemo.test_fit import STEPS, _assert_matches_reference
from tests.nemo.tiny_bert import reference_training, scratch_dir


@pytest.mark.slow
def test_data_parallel_fused_head_fit_equals_pytorch_on_whole_global_batches() -> None:
    with single_process_megatron(), megatron_on_cpu():
        reference = reference_training(STEPS)
    with scratch_dir() as out_dir:
        results = fit(out_dir, world_size=2, steps=STEPS, output="fused")
    assert [r["dp_rank"] for r in results] == [0, 1]
    _assert_matches_reference(results, reference)


@pytest.mark.slow
def test_tensor_parallel_fused_head_fit_equals_the_logits_fit() -> None:
    runs = {}
    for output in ("fused", "logits"):
        with scratch_dir() as out_dir:
            runs[output] = fit(out_dir, world_size=2, steps=STEPS, output=output, tp=2)
    for fused, logits in zip(runs["fused"], runs["logits"], strict=True):
        assert fused["dp_rank"] == 0  # TP = 2 on 2 ranks: no data parallelism
        torch.testing.assert_close(
            torch.tensor(fused["losses"]), torch.tensor(logits["losses"]), rtol=1e-6, atol=0
        )
        assert fused["params"].keys() == logits["params"].keys()
        for name, value in fused["params"].items():
            torch.testing.assert_close(value, logits["params"][name], rtol=1e-5, atol=1e-6)
    # The vocab shards differ between the ranks: this is tensor parallelism.
    weights = [r["params"]["embedding.word_embeddings.weight"] for r in runs["fused"]]
    assert weights[0].shape[0] == 16 and not torch.equal(weights[0], weights[1])
