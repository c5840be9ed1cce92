"""Batch samplers that hand every step the same global batch, whatever the number of ranks.

Pass them as ``DataLoader(dataset, batch_sampler=...)``; with Lightning, with
``Trainer(use_distributed_sampler=False)`` (``docs/lightning.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler


def _replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank} for num_replicas={num_replicas}.")
    return num_replicas, rank


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for each global batch, this rank's contiguous share of its dataset indices.

    The order is that of ``DistributedSampler(num_replicas=1, shuffle=shuffle, seed=seed)`` at
    the current epoch (``self.sampler``, whose ``set_epoch`` Lightning calls); an incomplete
    last global batch is dropped. The ranks' shares, concatenated, are the global batch: a
    step sees the same samples on 1 rank or on 8 (``docs/lightning.md``).

    Args:
        dataset_size: Number of samples in the dataset.
        global_batch_size: Samples per optimizer step, over all data-parallel ranks.
        micro_batch_size: Samples per forward pass on one rank; only checked here, the module
            does the micro-batching.
        num_replicas: Data-parallel world size; ``torch.distributed``'s when ``None`` (1 when
            it is not initialized).
        rank: This rank; ``torch.distributed``'s when ``None`` (0 when it is not initialized).
        shuffle: Draw a new order every epoch; else the dataset's order.
        seed: Seed of the order, shared by all ranks.

    Raises:
        ValueError: If ``global_batch_size`` is not divisible by ``micro_batch_size *
            num_replicas``, the dataset holds fewer samples than one global batch, or the rank
            is invalid.

    Example:
        Rank 1 of 2, in dataset order: its half of each global batch of 4.

        >>> list(GlobalBatchSampler(10, 4, 2, num_replicas=2, rank=1, shuffle=False))
        [[2, 3], [6, 7]]
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        micro_batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.num_replicas, self.rank = _replicas_and_rank(num_replicas, rank)
        if micro_batch_size < 1 or global_batch_size < 1:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) and micro_batch_size "
                f"({micro_batch_size}) must be >= 1."
            )
        if global_batch_size % (micro_batch_size * self.num_replicas) != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by micro_batch_size * "
                f"data-parallel ranks = {micro_batch_size} * {self.num_replicas} = "
                f"{micro_batch_size * self.num_replicas}."
            )
        if dataset_size < global_batch_size:
            raise ValueError(
                f"The dataset holds {dataset_size} samples, fewer than one global batch of "
                f"global_batch_size={global_batch_size}: no training step could run."
            )
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.share = global_batch_size // self.num_replicas
        self.sampler = DistributedSampler(
            range(dataset_size), num_replicas=1, rank=0, shuffle=shuffle, seed=seed
        )

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch`` (Lightning calls this on ``self.sampler`` itself)."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.dataset_size // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = list(self.sampler)
        start = self.rank * self.share
        for step in range(len(self)):
            offset = step * self.global_batch_size + start
            yield order[offset : offset + self.share]


class ShardedEvalBatchSampler(Sampler[list[int]]):
    """Batches of this rank's contiguous slice of the dataset, every sample on exactly one rank.

    Rank ``r`` holds indices ``[r * n // w, (r + 1) * n // w)`` in order, cut into batches of
    ``batch_size`` with a smaller last one. Ranks may hold different numbers of batches (or
    none, when ``n < w``): where every forward runs a collective (FSDP2's all-gathers),
    iterate with :func:`bert_reduce.evaluation.eval_batches`, which evens them out.

    Args:
        dataset_size: Number of samples ``n``.
        batch_size: Samples per validation batch.
        num_replicas: World size ``w``; ``torch.distributed``'s when ``None``.
        rank: This rank; ``torch.distributed``'s when ``None``.

    Raises:
        ValueError: On a non-positive ``batch_size`` or an invalid rank.

    Example:
        Five samples on two ranks: rank 0 holds ``0, 1``, rank 1 ``2, 3, 4``.

        >>> [list(ShardedEvalBatchSampler(5, 2, num_replicas=2, rank=r)) for r in (0, 1)]
        [[[0, 1]], [[2, 3], [4]]]
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.num_replicas, self.rank = _replicas_and_rank(num_replicas, rank)
        self.batch_size = batch_size
        self.start = self.rank * dataset_size // self.num_replicas
        self.stop = (self.rank + 1) * dataset_size // self.num_replicas

    def __len__(self) -> int:
        return -(-(self.stop - self.start) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for begin in range(self.start, self.stop, self.batch_size):
            yield list(range(begin, min(begin + self.batch_size, self.stop)))


def check_sampler_placement(dataloaders: Iterable[object], world_size: int, rank: int) -> None:
    """Raise ``ValueError`` if a loader's :class:`GlobalBatchSampler` has the wrong rank.

    A sampler built before the process group existed (at module level of a script that
    Lightning's DDP launcher runs once per rank, say) believes it is rank 0 of 1: every rank
    would then train on the whole global batch. Looks at each loader's ``batch_sampler`` and at
    a ``batch_sampler`` attribute of it (a wrapper's); other samplers are not checked.

    Args:
        dataloaders: The training loaders.
        world_size: The trainer's data-parallel world size.
        rank: The trainer's global rank.

    Raises:
        ValueError: Naming the sampler's and the trainer's ranks and world sizes.
    """
    for loader in dataloaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        for sampler in (batch_sampler, getattr(batch_sampler, "batch_sampler", None)):
            if not isinstance(sampler, GlobalBatchSampler):
                continue
            if (sampler.num_replicas, sampler.rank) != (world_size, rank):
                raise ValueError(
                    f"The training GlobalBatchSampler is rank {sampler.rank} of "
                    f"{sampler.num_replicas}, but this process is rank {rank} of {world_size}. "
                    "Build the sampler once the process group exists (in train_dataloader() "
                    "of the LightningDataModule or LightningModule), or pass num_replicas and "
                    "rank."
                )


def _placed(dataloader: object) -> tuple[str, int, int] | None:
    """``(name, samples placed on all ranks, ranks)`` of a sampler that evens out the ranks."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        # Lightning's UnrepeatedDistributedSampler sets total_size to the dataset's size.
        if isinstance(sampler, DistributedSampler):
            return "DistributedSampler", sampler.total_size, sampler.num_replicas
    # Accelerate's BatchSamplerShard (what accelerator.prepare gives a DataLoader): with
    # even_batches every rank yields len() full batches, cycling back to the first samples.
    if getattr(batch_sampler, "even_batches", False) and batch_sampler.batch_size is not None:
        ranks = batch_sampler.num_processes
        per_batch = batch_sampler.batch_size * (1 if batch_sampler.split_batches else ranks)
        return "Accelerate BatchSamplerShard", len(batch_sampler) * per_batch, ranks
    return None


def check_no_repeated_samples(dataloaders: DataLoader | Iterable[DataLoader] | None) -> None:
    """Raise ``ValueError`` if a distributed sampler repeats or drops evaluation samples.

    ``DistributedSampler`` (Lightning's default under DDP) and ``accelerator.prepare``'s batch
    sampler (``even_batches=True``) repeat or drop samples to even out ranks
    (``docs/perplexity.md``): the sums would count them twice or miss them.

    Args:
        dataloaders: A dataloader, a collection of them (as ``trainer.val_dataloaders``), or
            ``None``. Only ``DataLoader``-like objects' ``sampler``, ``batch_sampler`` and
            ``batch_sampler.sampler`` are inspected.

    Raises:
        ValueError: Naming the sampler, the dataset size, the number of ranks and the samples
            repeated or dropped, and the fix.

    Example:
        >>> from torch.utils.data import DataLoader, DistributedSampler
        >>> data = list(range(5))
        >>> check_no_repeated_samples(DataLoader(data, sampler=DistributedSampler(data, 2, 0)))
        Traceback (most recent call last):
        ...
        ValueError: Evaluation dataloader 0: its DistributedSampler repeats 1 of the 5 samples ...
    """
    if dataloaders is None:
        return
    if isinstance(dataloaders, DataLoader):
        dataloaders = [dataloaders]
    elif isinstance(dataloaders, Mapping):
        dataloaders = list(dataloaders.values())
    for index, dataloader in enumerate(dataloaders):
        placed = _placed(dataloader)
        if placed is None or placed[1] == len(dataloader.dataset):  # type: ignore[attr-defined]
            continue
        dataset_size = len(dataloader.dataset)  # type: ignore[attr-defined]
        name, total, ranks = placed
        change = total - dataset_size
        what = f"repeats {change}" if change > 0 else f"drops {-change}"
        raise ValueError(
            f"Evaluation dataloader {index}: its {name} {what} of the {dataset_size} samples "
            f"to give each of {ranks} ranks the same number, so the loss and perplexity would "
            "not be those of the evaluation set. Give the DataLoader a sampler that places "
            "every sample on exactly one rank: "
            "batch_sampler=bert_reduce.sampling.ShardedEvalBatchSampler(len(dataset), "
            "batch_size) (with Lightning, and Trainer(use_distributed_sampler=False)), or "
            "Lightning's UnrepeatedDistributedSampler; with Accelerate, leave the loader "
            "unprepared or pass Accelerator(dataloader_config=DataLoaderConfiguration("
            "even_batches=False))."
        )
