"""The one context-parallel index rule: load-balanced chunks, padded rows and packed rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from bert_reduce.context_parallel import (
    context_parallel_indices,
    get_batch_on_this_cp_rank,
    get_packed_batch_on_this_cp_rank,
    packed_context_parallel_indices,
)
from bert_reduce.num_scored import NumScoredCollator
from bert_reduce.packing import pack_batch
from tests.helpers.sync_guard import forbid_host_syncs


def loop_partition(cu_seqlens_padded: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Transformer Engine's THD partitioning, written as a plain loop."""
    out = []
    for start, end in itertools.pairwise(cu_seqlens_padded):
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_indices_match_the_loop_and_cover_each_position_once(cp_size) -> None:
    bounds = torch.tensor([0, 8, 16, 24, 56, 64])
    seen = []
    for cp_rank in range(cp_size):
        with forbid_host_syncs():
            index = packed_context_parallel_indices(bounds, 64, cp_size, cp_rank)
            padded = context_parallel_indices(24, cp_size, cp_rank)  # one sequence per row
        assert index.tolist() == loop_partition(bounds.tolist(), cp_size, cp_rank)
        assert padded.tolist() == loop_partition([0, 24], cp_size, cp_rank)
        seen += index.tolist()
    assert sorted(seen) == list(range(64))


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


def test_the_recipe_collators_output_is_sliced_and_recounted_per_shard() -> None:
    """The library's own collator output slices (``[b, s]`` attention mask, host counts)."""
    from bert_reduce.recipe.data import MLMCollator, MLMDataset

    sequences = ["MKVLAAGIW", "MSTNPKPQRKTKRNTNRRPQDV", "MAL"]
    dataset = MLMDataset(sequences, max_length=24, mask_prob=0.3)
    batch = MLMCollator(pad_to_multiple_of=4)([dataset[i] for i in range(3)])
    total = NumScoredCollator(MLMCollator(pad_to_multiple_of=4))([dataset[i] for i in range(3)])
    for cp_rank in range(2):
        shard = get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=cp_rank)
        index = context_parallel_indices(batch["labels"].size(1), 2, cp_rank)
        for key in ("input_ids", "attention_mask", "labels", "loss_mask"):
            assert torch.equal(shard[key], batch[key][:, index]), key
        # Per-sample counts stay per-sample, an int stays an int: each this shard's own.
        assert shard["num_scored"] == tuple(shard["loss_mask"].sum(dim=1).tolist())
        one = get_batch_on_this_cp_rank(total, cp_size=2, cp_rank=cp_rank)
        assert type(one["num_scored"]) is int
        assert one["num_scored"] == int(shard["loss_mask"].sum()) < total["num_scored"]
    # On a device the whole count is kept: an upper bound for the shard, read without a sync.
    on_device = {**total, "loss_mask": total["loss_mask"].to("meta")}
    with forbid_host_syncs():
        shard = get_batch_on_this_cp_rank(on_device, cp_size=2, cp_rank=0)
    assert shard["num_scored"] == total["num_scored"]


def test_packed_shards_are_recounted() -> None:
    labels = torch.arange(24).view(2, 12)
    mask = torch.rand(2, 12, generator=torch.Generator().manual_seed(3)) < 0.5
    batch = pack_batch(
        {"labels": labels, "loss_mask": mask, "num_scored": int(mask.sum())},
        [12, 8],
        pad_to_multiple_of=4,
    )
    assert batch["num_scored"] == int(mask.sum())  # packing keeps the count
    counts = []
    for cp_rank in range(2):
        shard = get_packed_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=cp_rank)
        assert shard["num_scored"] == int(shard["loss_mask"].sum())
        counts.append(shard["num_scored"])
    assert sum(counts) == int(mask[:, :12].sum() - mask[1, 8:].sum())
