"""Real NeMo 2 fits (``tests.helpers.nemo_bert.fit``) equal one-process PyTorch on whole batches.

One fit per set of processes: NeMo's groups do not survive a second fit in the same process.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import torch

from tests.helpers.nemo_bert import (
    MICRO_BATCH,
    assert_exact_validation,
    assert_matches_reference,
    fit,
    reference_training,
    train_dataset,
)
from tests.helpers.reference import assert_close_by_name

pytestmark = pytest.mark.slow


def test_data_parallel_fit_and_validation_equal_pytorch_on_whole_batches() -> None:
    # Masked tokens of each micro-batch (row) on each DP rank (column), as NeMo's Megatron
    # sampler deals them: rank 1 has an empty micro-batch, and the ranks' totals differ.
    counts = train_dataset().loss_mask.unflatten(0, (-1, 2, MICRO_BATCH)).sum((2, 3))
    assert 0 in counts[:, 1] and counts[:, 0].sum() != counts[:, 1].sum()
    results = fit(world_size=2, validation="wrapped")
    assert [r["dp_rank"] for r in results] == [0, 1]
    assert_matches_reference(results, reference_training())
    assert_exact_validation(results)
    # Megatron's sampler dealt 8 samples to each rank: 7 and 6 of them real.
    assert [run["real_on_rank"] for run in results] == [7, 6]
    # NeMo's own val_loss, a mean of the steps' means, is another value.
    means = results[0]["nemo_step_means"]
    assert abs(sum(means) / len(means) - reference_training()[2]) > 1e-3


def test_pipeline_parallel_fit_and_validation_are_exact_on_every_stage() -> None:
    """DP=2 x PP=2 on ``lm_loss``: the loss reaches rank 0, tied weights exact; the last
    stage's two ranks hold 7 and 6 real validation samples' reports."""
    results = fit(world_size=4, pp=2, output="lm_loss", validation="plain")
    ranks = {(r["pp_rank"], r["dp_rank"]): r for r in results}
    assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "embedding.word_embeddings.weight" in ranks[0, 0]["params"]
    assert "output_layer.weight" in ranks[1, 0]["params"]
    # NeMo sends the logged training loss from the last stage to rank 0 only
    # (_sync_from_last_pipeline_stage(broadcast=False)): the first stage's other rank logs 0.
    logging = [ranks[0, 0], ranks[1, 0], ranks[1, 1]]
    assert_matches_reference(logging, reference_training())
    # A data-parallel replica.
    assert_close_by_name(ranks[0, 1]["params"], ranks[0, 0]["params"], rtol=0, atol=0)
    assert_exact_validation(results)
    assert sorted(run["real_on_rank"] for run in results) == [6, 6, 7, 7]


def test_fused_head_fit_is_exact_and_a_dropped_sample_stops_validation() -> None:
    """NeMo's own MegatronDataSampler drops the last partial global batch: 5 of 13 samples."""
    results = fit(world_size=2, output="fused", validation="nemo_sampler")
    assert [r["dp_rank"] for r in results] == [0, 1]
    assert_matches_reference(results, reference_training())
    for run in results:
        assert "cover 8 real samples" in run["error"] and "has 13" in run["error"]
        assert "ExactValidationDataSampler" in run["error"]
        assert "val_loss" not in run["logged"] and "val_ppl" not in run["logged"]


def test_tensor_parallel_fused_head_fit_equals_the_logits_fit() -> None:
    fused, logits = fit(world_size=2, tp=2, output="fused"), fit(world_size=2, tp=2)
    for fused_rank, logits_rank in zip(fused, logits, strict=True):
        assert fused_rank["dp_rank"] == 0  # TP = 2 on 2 ranks: no data parallelism
        assert_matches_reference([fused_rank], (logits_rank["losses"], logits_rank["params"]))
    # The vocab shards differ between the ranks: this is tensor parallelism.
    weights = [r["params"]["embedding.word_embeddings.weight"] for r in fused]
    assert weights[0].shape[0] == 16 and not torch.equal(weights[0], weights[1])
