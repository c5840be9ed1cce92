"""Exact evaluation in a loop of one's own: every sample counted once, every rank in step.

Usage: ``docs/pytorch_loop.md#validation``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from bert_reduce import distributed
from bert_reduce.num_scored import NUM_SCORED_KEY
from bert_reduce.sampling import check_no_repeated_samples


def _scoring_nothing(batch: Mapping[str, Any], ignore_index: int) -> dict[str, Any]:
    """``batch`` with every label ``ignore_index``: a forward that adds 0 to every sum."""
    if not isinstance(batch, Mapping) or "labels" not in batch:
        raise KeyError("eval_batches() needs batches that are mappings with 'labels'.")
    empty = {**batch, "labels": torch.full_like(batch["labels"], ignore_index)}
    if "loss_mask" in batch:
        empty["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    if NUM_SCORED_KEY in batch:
        empty[NUM_SCORED_KEY] = 0
    return empty


def eval_batches(
    dataloader: DataLoader,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> Iterator[dict[str, Any]]:
    """This rank's evaluation batches, then batches scoring nothing until all ranks ran as many.

    Every rank of ``group`` yields as many batches as the rank with the most: its own, then
    copies of its last one (of ``dataloader.collate_fn([dataset[0]])`` on a rank without any,
    not moved to any device) with ``labels`` all ``ignore_index``, ``loss_mask`` and
    ``num_scored`` (if any) 0. One all-reduce and one host read per evaluation.

    Args:
        dataloader: This rank's evaluation loader, of mappings with ``labels`` (``[b, s]``);
            it must place every sample on exactly one rank (see
            :func:`bert_reduce.sampling.check_no_repeated_samples`).
        group: The ranks that run forwards together; by default
            :func:`bert_reduce.distributed.loss_reduction_group` (none in one process).
        ignore_index: Label value of unscored tokens.

    Yields:
        The batches, as the loader gives them, then the batches scoring nothing.

    Raises:
        ValueError: Naming the sampler, when ``dataloader`` repeats or drops samples.
        KeyError: When a batch is not a mapping with ``labels``.

    Example:
        In one process, the loader's batches. Run by 3 ranks, rank 0 (samples 0-3) would
        then yield a batch scoring nothing, as rank 2 (samples 8-12) holds 3 batches.

        >>> from torch.utils.data import DataLoader
        >>> from bert_reduce.sampling import ShardedEvalBatchSampler
        >>> data = [{"labels": torch.tensor([i, -100])} for i in range(13)]
        >>> loader = DataLoader(
        ...     data, batch_sampler=ShardedEvalBatchSampler(13, 2, num_replicas=3, rank=0)
        ... )
        >>> [batch["labels"][:, 0].tolist() for batch in eval_batches(loader)]  # one process
        [[0, 1], [2, 3]]
    """
    check_no_repeated_samples(dataloader)
    group = group if group is not None else distributed.loss_reduction_group()
    count = len(dataloader)
    most = count
    if group is not None and dist.get_world_size(group) > 1:
        counts = torch.tensor(count, device=distributed.default_device())
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
        most = int(counts)  # the one host read
    batch = None
    for batch in dataloader:
        yield batch
    if most > count:
        if batch is None:
            batch = dataloader.collate_fn([dataloader.dataset[0]])  # type: ignore[index]
        empty = _scoring_nothing(batch, ignore_index)
        for _ in range(most - count):
            yield empty
