"""Real NeMo 2 fits with bert_reduce's loss equal one-process PyTorch on whole global batches.

``tests.helpers.nemo_bert.fit``: Megatron-Core's BERT with tied embeddings and
``calculate_per_token_loss=True``, 3 steps on gloo processes, every step with micro-batches of
different masked counts, one of them with none. Every parameter, and the loss NeMo logged at
every step on every rank, equal ``reference_training`` (fp32 tolerances).
"""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")


from tests.helpers.nemo_bert import (
    GLOBAL_BATCH,
    MICRO_BATCH,
    STEPS,
    assert_matches_reference,
    fit,
    reference_training,
    train_dataset,
)

pytestmark = pytest.mark.slow


def _masked_counts_per_rank(dp: int) -> list[list[int]]:
    """Masked tokens of each micro-batch per DP rank, as NeMo's Megatron sampler deals them."""
    mask = train_dataset(STEPS).loss_mask
    counts: list[list[int]] = [[] for _ in range(dp)]
    for start in range(0, STEPS * GLOBAL_BATCH, MICRO_BATCH * dp):
        for rank in range(dp):
            rows = slice(start + rank * MICRO_BATCH, start + (rank + 1) * MICRO_BATCH)
            counts[rank].append(int(mask[rows].sum()))
    return counts


@pytest.mark.parametrize("dp", [1, 2])
def test_data_parallel_fit_equals_pytorch_on_whole_global_batches(dp) -> None:
    counts = _masked_counts_per_rank(dp)
    assert 0 in counts[-1] and len({sum(c) for c in counts}) == dp  # an empty micro-batch; unequal
    assert_matches_reference(fit(world_size=dp), reference_training())


def test_pipeline_parallel_fit_with_tied_embeddings_equals_pytorch() -> None:
    """PP=2 on Megatron's per-token ``lm_loss``: the loss reaches rank 0, tied weights exact."""
    results = fit(world_size=2, pp=2, output="lm_loss")
    assert [r["pp_rank"] for r in results] == [0, 1]
    assert "embedding.word_embeddings.weight" in results[0]["params"]
    assert "output_layer.weight" in results[1]["params"]
    assert_matches_reference(results, reference_training())
