"""Validation data for NeMo 2 that drops nothing: every sample of the set on exactly one rank.

Why NeMo's own sampler does not, and how this one is used: ``docs/nemo.md``, "Exact validation
loss and perplexity".
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.trainer.states import RunningStage
from nemo.lightning.pytorch.plugins import MegatronDataSampler
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override


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


class RealSampleTracker:
    """A batch sampler that records which of the indices it deals are real samples.

    Wraps this rank's batch sampler over a :class:`PaddedEvalDataset`: indices below
    ``num_real`` are the dataset's own samples, the others padding. Each pass (``iter``)
    starts a new record, :attr:`is_real`, one flag per dealt index in order: the ``k``-th
    micro-batch the model sees holds the flags ``k * b`` to ``(k + 1) * b`` for micro-batches
    of ``b`` samples, however far the loader's workers have read ahead.

    Args:
        batch_sampler: Yields lists of dataset indices (Megatron's sampler for this rank).
        num_real: Number of real samples, ``len`` of the unpadded dataset.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], num_real: int) -> None:
        self.batch_sampler = batch_sampler
        self.num_real = num_real
        self.is_real: list[bool] = []

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        self.is_real = []  # now, when the loader starts a pass, not at the first batch
        return self._record(iter(self.batch_sampler))

    def _record(self, batches: Iterator[list[int]]) -> Iterator[list[int]]:
        for batch in batches:
            self.is_real.extend(0 <= index < self.num_real for index in batch)
            yield batch

    def real_samples_in_first(self, num_samples: int) -> int:
        """How many of the first ``num_samples`` indices dealt in this pass are real samples.

        Raises:
            ValueError: If fewer than ``num_samples`` indices were dealt in this pass.
        """
        if num_samples > len(self.is_real):
            raise ValueError(
                f"{num_samples} samples were counted, but this rank's validation sampler dealt "
                f"only {len(self.is_real)} in this pass."
            )
        return sum(self.is_real[:num_samples])


def _loader_like(dataloader: DataLoader, dataset: Dataset, **kwargs: Any) -> DataLoader:
    """A loader over ``dataset`` with what NeMo's ``add_megatron_sampler`` keeps of another."""
    return DataLoader(
        dataset,
        num_workers=dataloader.num_workers,
        pin_memory=dataloader.pin_memory,
        persistent_workers=dataloader.persistent_workers,
        collate_fn=dataloader.collate_fn,
        **kwargs,
    )


class ExactValidationDataSampler(MegatronDataSampler):
    """NeMo's ``MegatronDataSampler`` that keeps the whole validation and test sets.

    Same arguments as ``MegatronDataSampler``; training is unchanged. Validation and test
    datasets are wrapped in :class:`PaddedEvalDataset` (to a multiple of ``global_batch_size``),
    the validation loader's batch sampler in a :class:`RealSampleTracker` (``docs/nemo.md``).
    """

    @classmethod
    def from_sampler(cls, sampler: MegatronDataSampler) -> ExactValidationDataSampler:
        """An ``ExactValidationDataSampler`` with the settings of ``sampler``.

        For data modules that build their own (NeMo's, BioNeMo's), e.g.
        ``dm.data_sampler = ExactValidationDataSampler.from_sampler(dm.data_sampler)``.
        """
        # MegatronDataSampler keeps each of its arguments under the argument's name.
        names = list(inspect.signature(MegatronDataSampler.__init__).parameters)[1:]
        return cls(**{name: getattr(sampler, name) for name in names})

    def loader_mode(self, dataloader: DataLoader) -> str:
        """``"train"``, ``"validation"``, ``"test"`` or ``"predict"``: the loader being built.

        From ``trainer.state.stage``; without a trainer (NeMo's Fabric strategy) the loader's
        ``mode`` attribute, as NeMo reads it (``"train"`` when it has none).
        """
        state = getattr(getattr(self, "trainer", None), "state", None)
        stage = getattr(state, "stage", None)
        if isinstance(stage, RunningStage):
            # Lightning's loader prefix ("train", "val", "test", "predict"); NeMo's "validation".
            prefix = stage.dataloader_prefix
            return "validation" if prefix == "val" else prefix
        return getattr(dataloader, "mode", "train")

    @override
    def transform_dataloader(self, dataloader: DataLoader, consumed_samples: int = 0) -> DataLoader:
        mode = self.loader_mode(dataloader)
        dataset = dataloader.dataset
        if mode in ("validation", "test"):
            dataset = PaddedEvalDataset(dataset, self.global_batch_size)
        # NeMo's MegatronDataSampler reads the kind of loader from its `mode` attribute.
        carrier = _loader_like(dataloader, dataset)
        carrier.mode = mode  # type: ignore[attr-defined]
        loader = super().transform_dataloader(carrier, consumed_samples)
        if mode != "validation":
            return loader
        tracker = RealSampleTracker(loader.batch_sampler, len(dataloader.dataset))
        return _loader_like(loader, loader.dataset, batch_sampler=tracker)
