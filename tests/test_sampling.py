from __future__ import annotations

import itertools

import pytest
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from bert_reduce.sampling import (
    GlobalBatchSampler,
    ShardedEvalBatchSampler,
    check_no_repeated_samples,
    check_sampler_placement,
)


def _global_batches(world_size: int, micro_batch_size: int, epoch: int) -> list[list[int]]:
    """Each step's global batch, reassembled from the shares of ranks 0 .. world_size - 1."""
    samplers = [
        GlobalBatchSampler(
            50, 12, micro_batch_size, num_replicas=world_size, rank=rank, shuffle=True, seed=7
        )
        for rank in range(world_size)
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    shares = [list(sampler) for sampler in samplers]
    assert all(len(share) == 12 // world_size for steps in shares for share in steps)
    return [list(itertools.chain(*step)) for step in zip(*shares, strict=True)]


@pytest.mark.parametrize("epoch", [0, 1])
def test_same_global_batches_whatever_the_ranks_and_micro_batches(epoch: int) -> None:
    reference = _global_batches(world_size=1, micro_batch_size=12, epoch=epoch)
    assert len(reference) == 50 // 12
    assert all(len(batch) == 12 for batch in reference)
    flat = list(itertools.chain(*reference))
    assert len(set(flat)) == len(flat)  # no sample twice in an epoch
    for world_size, micro_batch_size in [(1, 1), (2, 3), (3, 2), (4, 1), (6, 2)]:
        assert _global_batches(world_size, micro_batch_size, epoch) == reference


def test_lightning_sets_the_epoch_through_the_dataloader() -> None:
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.data import _set_sampler_epoch

    sampler = GlobalBatchSampler(20, 4, 1, num_replicas=1, rank=0, seed=3)
    loader = DataLoader(range(20), batch_sampler=sampler)
    _set_sampler_epoch(loader, 5)
    expected = GlobalBatchSampler(20, 4, 1, num_replicas=1, rank=0, seed=3)
    expected.set_epoch(5)
    assert list(sampler) == list(expected)
    assert list(sampler) != list(GlobalBatchSampler(20, 4, 1, num_replicas=1, rank=0, seed=3))


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            (100, 16, 3),
            r"global_batch_size=16 is not divisible by micro_batch_size \* data-parallel ranks "
            r"= 3 \* 2 = 6",
        ),
        ((10, 16, 4), r"holds 10 samples, fewer than one global batch of global_batch_size=16"),
        ((10, 0, 4), r"must be >= 1"),
    ],
)
def test_global_batch_sampler_errors(sizes: tuple[int, int, int], message: str) -> None:
    """``sizes``: dataset_size, global_batch_size, micro_batch_size."""
    with pytest.raises(ValueError, match=message):
        GlobalBatchSampler(*sizes, num_replicas=2, rank=0)


def test_invalid_rank() -> None:
    with pytest.raises(ValueError, match=r"Invalid rank 2 for num_replicas=2"):
        ShardedEvalBatchSampler(10, 2, num_replicas=2, rank=2)


@pytest.mark.parametrize("dataset_size", [1, 7, 10, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_sampler_places_every_sample_on_exactly_one_rank(
    dataset_size: int, world_size: int
) -> None:
    batches = [
        list(ShardedEvalBatchSampler(dataset_size, 4, num_replicas=world_size, rank=rank))
        for rank in range(world_size)
    ]
    flat = [i for rank_batches in batches for batch in rank_batches for i in batch]
    assert flat == list(range(dataset_size))
    assert all(1 <= len(batch) <= 4 for rank_batches in batches for batch in rank_batches)
    for rank in range(world_size):
        sampler = ShardedEvalBatchSampler(dataset_size, 4, num_replicas=world_size, rank=rank)
        assert len(sampler) == len(batches[rank])


class _Wrapper:
    def __init__(self, batch_sampler: GlobalBatchSampler) -> None:
        self.batch_sampler = batch_sampler

    def __iter__(self):
        return iter(self.batch_sampler)


def test_sampler_placement_is_checked_through_one_wrapper() -> None:
    right = GlobalBatchSampler(20, 4, 1, num_replicas=2, rank=1)
    wrong = GlobalBatchSampler(20, 4, 1, num_replicas=1, rank=0)
    check_sampler_placement([DataLoader(range(20), batch_sampler=right)], world_size=2, rank=1)
    with pytest.raises(ValueError, match=r"is rank 0 of 1, but this process is rank 1 of 2"):
        check_sampler_placement(
            [DataLoader(range(20), batch_sampler=_Wrapper(wrong))], world_size=2, rank=1
        )


def test_check_no_repeated_samples_names_the_sampler() -> None:
    # A padding DistributedSampler: the function's doctest, and tests/test_evaluation.py.
    data = list(range(11))
    dropping = DistributedSampler(data, 2, 1, shuffle=False, drop_last=True)
    with pytest.raises(ValueError, match=r"drops 1 of the 11 samples to give each of 2 ranks"):
        check_no_repeated_samples([DataLoader(data, sampler=dropping)])
    even = list(range(12))
    check_no_repeated_samples({"val": DataLoader(even, sampler=DistributedSampler(even, 2, 0))})
    sharded = ShardedEvalBatchSampler(11, 4, num_replicas=2, rank=1)
    check_no_repeated_samples(DataLoader(data, batch_sampler=sharded))
    distributed = pytest.importorskip("lightning.pytorch.overrides.distributed")
    unrepeated = distributed.UnrepeatedDistributedSampler(data, 2, 1, shuffle=False)
    check_no_repeated_samples(DataLoader(data, sampler=unrepeated))


@pytest.mark.parametrize(
    ("size", "split", "even", "repeated"),
    [(13, False, True, 3), (16, False, True, 0), (13, True, True, 3), (13, False, False, 0)],
)
def test_check_no_repeated_samples_sees_accelerates_even_batches(
    size: int, split: bool, even: bool, repeated: int
) -> None:
    shard = pytest.importorskip("accelerate.data_loader").BatchSamplerShard
    batches = BatchSampler(SequentialSampler(range(size)), 4, drop_last=False)
    placed = [
        i
        for rank in (0, 1)
        for batch in shard(batches, 2, rank, split_batches=split, even_batches=even)
        for i in batch
    ]
    assert len(placed) - size == repeated  # what Accelerate itself yields
    loader = DataLoader(range(size), batch_sampler=shard(batches, 2, 0, split, even_batches=even))
    if repeated:
        with pytest.raises(ValueError, match=rf"BatchSamplerShard repeats {repeated} of the 13"):
            check_no_repeated_samples(loader)
    else:
        check_no_repeated_samples(loader)
