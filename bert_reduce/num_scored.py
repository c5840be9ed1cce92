"""The count of scored positions, made on the host where the batch is built.

Given ``num_scored``, the masked-only kernels compute exactly that many rows with no device
sync (``docs/fast_path.md``), so the count is made while the mask is still on the host (the
collator, or a data step before the batch moves) and carried as host data that no device
transfer touches (Lightning's and NeMo's ``move_data_to_device``, Hugging Face's
``_prepare_inputs`` and ``.to(device)`` loops leave it alone; its forms: :data:`NumScored`).
Scored is the loss's own rule: ``loss_mask != 0``, else ``labels != ignore_index``. Too high a
count costs unscored rows of work; too low, a NaN loss (never a silently wrong one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from torch import Tensor

NUM_SCORED_KEY = "num_scored"
"""The batch key of the count."""

NumScored = int | tuple[int, ...] | list[int] | Tensor
"""The data pipeline's count of scored positions, as a kernel takes it: a Python ``int``, a
tuple (or list) of per-sample ints to sum, or an integer tensor of counts to sum (e.g. a
``[b]`` per-sample tensor). Ints and CPU tensors are host data, read with no device sync; a
tensor on an accelerator is read once (one sync)."""


def scored_count(num_scored: NumScored) -> int:
    """The number of scored positions a :data:`NumScored` stands for, as a Python ``int``.

    Raises:
        TypeError: If ``num_scored`` is neither an ``int``, a tuple of ints nor an integer
            tensor.
        ValueError: If it counts fewer than zero positions.
    """
    if isinstance(num_scored, Tensor) and not num_scored.dtype.is_floating_point:
        if num_scored.device.type == "cpu":
            # Host memory, read through numpy: no device involved.
            count = int(num_scored.numpy().sum())
        else:
            # The price of a count left on the accelerator: one device-to-host sync.
            count = int(num_scored.sum())
    elif isinstance(num_scored, int) and not isinstance(num_scored, bool):
        count = num_scored
    elif isinstance(num_scored, tuple | list) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in num_scored
    ):
        count = sum(num_scored)
    else:
        raise TypeError(
            "num_scored must be a Python int, a tuple of ints or an integer tensor of counts, got "
            f"{num_scored.dtype if isinstance(num_scored, Tensor) else type(num_scored).__name__}."
        )
    if count < 0:
        raise ValueError(f"num_scored must be non-negative, got a sum of {count}.")
    return count


def count_scored(
    batch: Mapping[str, Any], *, ignore_index: int = -100, per_sample: bool = False
) -> int | tuple[int, ...]:
    """The number of positions a host batch scores, as Python ints.

    Example:
        >>> import torch
        >>> count_scored({"labels": torch.tensor([[5, -100, 7], [-100, -100, 2]])})
        3

    Args:
        batch: A collated batch on the CPU: ``loss_mask`` (``[b, s]``, non-zero where scored),
            or else ``labels`` (``[b, s]``, ``ignore_index`` where unscored).
        ignore_index: The unscored label, read only without a ``loss_mask``.
        per_sample: Return each sample's count (a tuple of ``b`` ints) instead of the total.

    Returns:
        The total, or the per-sample counts.

    Raises:
        KeyError: If the batch has neither ``loss_mask`` nor ``labels``.
        ValueError: If that tensor is not on the CPU (counting would be a device sync) or is
            0-dim.
    """
    mask = batch.get("loss_mask")
    name = "labels" if mask is None else "loss_mask"
    if name not in batch:
        raise KeyError(
            f"Counting scored positions needs batch['loss_mask'] or batch['labels']; the "
            f"batch has {sorted(batch)}."
        )
    scored = batch[name]
    if not isinstance(scored, Tensor) or scored.dim() < 1:
        raise ValueError(f"batch[{name!r}] must be a [b, s] tensor to count its scored positions.")
    if scored.device.type != "cpu":
        raise ValueError(
            f"batch[{name!r}] is on {scored.device}: reading it to count would synchronize with "
            "the device. Count where the batch is still on the host (NumScoredCollator in the "
            "data loader, or a data step before it moves the batch)."
        )
    scored = scored != ignore_index if mask is None else scored != 0
    if not per_sample:
        return int(scored.count_nonzero())
    # Host memory: tolist() reads it without involving any device.
    return tuple(scored.reshape(scored.size(0), -1).sum(dim=1).tolist())


class NumScoredCollator:
    """Any collator, plus ``num_scored``: its batches' count of scored positions.

    Wraps a ``collate_fn`` (BioNeMo's ``bert_padding_collate_fn``, Hugging Face's
    ``DataCollatorForLanguageModeling``, ``torch.utils.data.default_collate``, ...) and adds
    ``batch["num_scored"]`` as :func:`count_scored` makes it, in the data loader's workers,
    on the CPU: the count costs the training step nothing.

    Args:
        collate_fn: Turns a list of samples into a mapping with ``loss_mask`` or ``labels``.
        ignore_index: As in :func:`count_scored`.
        per_sample: As in :func:`count_scored`: for a loader whose batches are cut into
            micro-batches after they are moved (:class:`bert_reduce.lightning.ExactMLMModule`).

    Example:
        >>> import torch
        >>> from torch.utils.data import default_collate
        >>> samples = [{"labels": torch.tensor([5, -100])}, {"labels": torch.tensor([7, 8])}]
        >>> NumScoredCollator(default_collate)(samples)["num_scored"]
        3
    """

    def __init__(
        self,
        collate_fn: Callable[[Sequence[Any]], MutableMapping[str, Any]],
        *,
        ignore_index: int = -100,
        per_sample: bool = False,
    ) -> None:
        self.collate_fn = collate_fn
        self.ignore_index = ignore_index
        self.per_sample = per_sample

    def __call__(self, samples: Sequence[Any]) -> MutableMapping[str, Any]:
        """``collate_fn(samples)`` with ``num_scored`` added.

        Raises:
            TypeError: If the collator does not return a mutable mapping.
        """
        batch = self.collate_fn(samples)
        if not isinstance(batch, MutableMapping):
            raise TypeError(
                f"NumScoredCollator needs a collator that returns a dict of tensors, got "
                f"{type(batch).__name__}."
            )
        batch[NUM_SCORED_KEY] = count_scored(
            batch, ignore_index=self.ignore_index, per_sample=self.per_sample
        )
        return batch
