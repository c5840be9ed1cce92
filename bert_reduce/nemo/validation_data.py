"""Validation data for NeMo 2 that drops nothing: every sample of the set on exactly one rank.

NeMo 2's ``MegatronDataSampler`` drops the validation set's last partial global batch.
:class:`ExactValidationDataSampler` instead pads the validation (and test) set to a multiple
of the global batch with copies of its first sample whose ``loss_mask`` is all zero
(:class:`PaddedEvalDataset`), so nothing is dropped and each rank holds the real samples
Megatron's sampler deals it (uneven shards). A padding sample adds 0 to the loss sum and 0 to
the token count. :class:`bert_reduce.nemo.NeMoValidationPerplexityCallback` then logs the
loss and perplexity of the whole set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from nemo.lightning.pytorch.plugins import MegatronDataSampler
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = ["ExactValidationDataSampler", "PaddedEvalDataset"]


class PaddedEvalDataset(Dataset):
    """``dataset``, then unscored copies of its first sample up to a multiple of ``multiple``.

    Args:
        dataset: Map-style dataset of mappings with a ``loss_mask`` tensor.
        multiple: The padded length is the smallest multiple of it ``>= len(dataset)``.

    Raises:
        ValueError: If ``dataset`` is empty or ``multiple < 1``.
    """

    def __init__(self, dataset: Dataset, multiple: int) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        if size == 0 or multiple < 1:
            raise ValueError(
                f"PaddedEvalDataset needs a non-empty dataset and multiple >= 1, got "
                f"{size} samples and multiple={multiple}."
            )
        self.dataset = dataset
        self.size = size
        self.padded_size = -(-size // multiple) * multiple

    def __len__(self) -> int:
        return self.padded_size

    def __getitem__(self, index: int) -> Any:
        if index < self.size:
            return self.dataset[index]
        sample = self.dataset[0]
        if not isinstance(sample, Mapping) or "loss_mask" not in sample:
            raise KeyError(
                "PaddedEvalDataset pads with an unscored copy of sample 0, which needs a "
                f"'loss_mask' key; sample 0 is a {type(sample).__name__}"
                f"{' with keys ' + str(sorted(sample)) if isinstance(sample, Mapping) else ''}."
            )
        return {**sample, "loss_mask": torch.zeros_like(sample["loss_mask"])}


class ExactValidationDataSampler(MegatronDataSampler):
    """NeMo's ``MegatronDataSampler`` that keeps the whole validation and test sets.

    Training is unchanged. Validation and test datasets are wrapped in
    :class:`PaddedEvalDataset` (to a multiple of ``global_batch_size``) before Megatron's
    sampler deals them out, so its ``drop_last`` drops nothing. Same arguments as
    ``MegatronDataSampler``. As for NeMo's own sampler, a loader's kind is its ``mode``
    attribute: return ``nemo.lightning.data.WrappedDataLoader(mode="validation", ...)`` from
    ``val_dataloader`` (NeMo's data modules do); a loader without it counts as training.
    """

    @override
    def transform_dataloader(self, dataloader: DataLoader, consumed_samples: int = 0) -> DataLoader:
        mode = getattr(dataloader, "mode", "train")
        if mode in ("validation", "test"):
            padded = DataLoader(
                PaddedEvalDataset(dataloader.dataset, self.global_batch_size),
                batch_size=dataloader.batch_size,
                collate_fn=dataloader.collate_fn,
                num_workers=dataloader.num_workers,
                pin_memory=dataloader.pin_memory,
            )
            padded.mode = mode  # type: ignore[attr-defined]
            dataloader = padded
        return super().transform_dataloader(dataloader, consumed_samples)
