"""A real NeMo 2 fit with bert_reduce's loss equals one-process PyTorch on whole global batches.

``nl.Trainer`` + ``nl.MegatronStrategy`` (Megatron DDP, ``average_in_collective=False``) +
``MegatronOptimizerModule`` (SGD with momentum, clipping at 1.0), Megatron-Core's BERT with
tied embeddings and ``calculate_per_token_loss=True``, on CPU/gloo processes
(:mod:`tests.nemo.cpu_stand_ins`). After 3 steps every parameter, and the loss NeMo logged at
every step, equal :func:`tests.nemo.tiny_bert.reference_training` (fp32 tolerances). Every
step has micro-batches with different masked counts, one of them with none.

Runs only where NeMo 2 is installed (``.venv-nemo``, see the ``nemo`` extra).
"""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import torch

from tests.helpers.megatron_cpu import single_process_megatron
from tests.nemo.cpu_stand_ins import megatron_on_cpu
from tests.nemo.fit_helpers import fit
from tests.nemo.tiny_bert import (
    EMPTY_IN_GLOBAL_BATCH,
    GLOBAL_BATCH,
    MICRO_BATCH,
    reference_training,
    scratch_dir,
    train_dataset,
)

STEPS = 3


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    with single_process_megatron(), megatron_on_cpu():
        return reference_training(STEPS)


def _masked_counts_per_rank(dp: int) -> list[list[int]]:
    """Masked tokens of each micro-batch per DP rank, as NeMo's Megatron sampler deals them."""
    mask = train_dataset(STEPS).loss_mask
    counts: list[list[int]] = [[] for _ in range(dp)]
    for start in range(0, STEPS * GLOBAL_BATCH, MICRO_BATCH * dp):
        for rank in range(dp):
            rows = slice(start + rank * MICRO_BATCH, start + (rank + 1) * MICRO_BATCH)
            counts[rank].append(int(mask[rows].sum()))
    return counts


def _assert_matches_reference(results, reference) -> None:
    ref_losses, ref_params = reference
    seen = set()
    for result in results:
        # Every rank, first pipeline stage included, logged the exact loss of every step.
        torch.testing.assert_close(
            torch.tensor(result["losses"]),
            torch.tensor(ref_losses, dtype=torch.float32),
            rtol=1e-6,
            atol=0,
        )
        for name, value in result["params"].items():
            # The last stage's copy of the tied output weight is the word embedding.
            ref_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
            torch.testing.assert_close(value, ref_params[ref_name], rtol=1e-5, atol=1e-6)
            seen.add(ref_name)
    assert seen == set(ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_data_parallel_fit_equals_pytorch_on_whole_global_batches(dp, reference) -> None:
    counts = _masked_counts_per_rank(dp)
    assert 0 in counts[-1] and len({sum(c) for c in counts}) == dp  # an empty micro-batch; unequal
    assert EMPTY_IN_GLOBAL_BATCH == (2, 3)
    with scratch_dir() as out_dir:
        results = fit(out_dir, world_size=dp, steps=STEPS)
    _assert_matches_reference(results, reference)


@pytest.mark.slow
def test_pipeline_parallel_fit_with_tied_embeddings_equals_pytorch(reference) -> None:
    """PP=2: the loss reaches rank 0 (float32 broadcast), tied weights stay tied and exact.

    The last stage hands the loss Megatron's per-token ``lm_loss`` ``[b, s]``.
    """
    with scratch_dir() as out_dir:
        results = fit(out_dir, world_size=2, steps=STEPS, pp=2, output="lm_loss")
    assert [r["pp_rank"] for r in results] == [0, 1]
    assert "embedding.word_embeddings.weight" in results[0]["params"]
    assert "output_layer.weight" in results[1]["params"]
    _assert_matches_reference(results, reference)
