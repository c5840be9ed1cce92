"""Gradient accumulation in a loop of one's own: each step's micro-batches, counted first."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

from bert_reduce.torch_loop import GlobalBatchLoss


def accumulation_steps(
    micro_batches: Iterable[Mapping[str, Any]], loss_fn: GlobalBatchLoss, steps: int
) -> Iterator[list[Mapping[str, Any]]]:
    """Each optimizer step's ``steps`` micro-batches, after ``loss_fn.begin()`` on them.

    Reads one micro-batch ahead; why, and the ``gradient_average_size`` Accelerate needs:
    ``docs/pytorch_loop.md``.

    Args:
        micro_batches: This rank's micro-batches, in order (a loader).
        loss_fn: The loss whose :meth:`~bert_reduce.GlobalBatchLoss.begin` each group is
            given to before it is yielded.
        steps: Micro-batches per optimizer step (gradient accumulation steps).

    Yields:
        A list of ``steps`` micro-batches; pass each to ``loss_fn`` once, then call
        ``loss_fn.end()``.

    Raises:
        ValueError: If ``steps < 1``, or the loader's last group holds fewer micro-batches.

    Example:
        >>> import torch
        >>> from bert_reduce import GlobalBatchLoss
        >>> loader = [{"labels": torch.tensor([[1, -100]])}] * 4
        >>> loss_fn = GlobalBatchLoss()
        >>> for micro_batches in accumulation_steps(loader, loss_fn, 2):
        ...     for mb in micro_batches:
        ...         share = loss_fn(torch.zeros(1, 2, 3), mb)  # logits [b, s, v]
        ...     print(f"{loss_fn.end():.4f}")
        1.0986
        1.0986
    """
    if steps < 1:
        raise ValueError(f"steps (gradient accumulation steps) must be >= 1, got {steps}.")
    iterator = iter(micro_batches)
    group = list(islice(iterator, steps))
    while group:
        if len(group) < steps:
            raise ValueError(
                f"The loader's last optimizer step has {len(group)} micro-batches, not "
                f"steps={steps}: give it a multiple of steps micro-batches (drop_last=True, "
                "or a dataset size that divides)."
            )
        following = list(islice(iterator, 1))
        loss_fn.begin(group)
        yield group
        group = following + list(islice(iterator, steps - 1))
