"""The one context-parallel index rule: load-balanced chunks, padded rows and packed rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from bert_reduce.context_parallel import (
    context_parallel_indices,
    get_batch_on_this_cp_rank,
    packed_context_parallel_indices,
)
from tests.helpers.sync_guard import forbid_host_syncs


def test_context_parallel_indices_are_load_balanced_and_cover_sequence() -> None:
    # cp=2, s=8: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert context_parallel_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        seen = torch.cat([context_parallel_indices(24, cp, r) for r in range(cp)])
        assert sorted(seen.tolist()) == list(range(24))


def test_context_parallel_slicer_errors() -> None:
    with pytest.raises(
        ValueError, match=r"Sequence length 10 must be divisible by 2 \* cp_size = 4"
    ):
        context_parallel_indices(10, 2, 0)
    with pytest.raises(ValueError, match="Invalid context-parallel rank 2 for cp_size=2"):
        context_parallel_indices(8, 2, 2)
    batch = {"labels": torch.zeros(2, 8, dtype=torch.long), "meta": "kept"}
    sliced = get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=1)
    assert sliced["labels"].shape == (2, 4) and sliced["meta"] == "kept"
    assert batch["labels"].shape == (2, 8)


def loop_partition(cu_seqlens_padded: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Transformer Engine's THD partitioning, written as a plain loop."""
    out = []
    for start, end in itertools.pairwise(cu_seqlens_padded):
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_packed_cp_indices_match_loop_and_cover_each_position_once(cp_size) -> None:
    bounds = torch.tensor([0, 8, 16, 24, 56, 64])
    seen = []
    for cp_rank in range(cp_size):
        with forbid_host_syncs():
            index = packed_context_parallel_indices(bounds, 64, cp_size, cp_rank)
        assert index.tolist() == loop_partition(bounds.tolist(), cp_size, cp_rank)
        seen += index.tolist()
    assert sorted(seen) == list(range(64))
