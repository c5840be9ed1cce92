"""Exact ``val_loss`` / ``val_ppl`` under NeMo 2: every masked token of the validation set.

NeMo 2 logs ``val_loss`` as a mean over validation steps of each step's reduced loss, and its
``MegatronDataSampler`` drops the validation set's last partial global batch. Two pieces make
the validation numbers those of the whole validation set, over any number of DP ranks:

* :class:`ExactValidationDataSampler` pads the validation (and test) set to a multiple of the
  global batch with copies of its first sample whose ``loss_mask`` is all zero, so nothing is
  dropped and each rank holds the real samples Megatron's sampler deals it (uneven shards).
  A padding sample adds 0 to the loss sum and 0 to the token count.
* :class:`NeMoValidationPerplexityCallback` reads the per-micro-batch reports NeMo hands its
  ``MegatronParallel`` callbacks (``on_megatron_reduce_microbatches_end``), adds up their
  ``(loss_sum, denominator)``, syncs the two sums once at the end of the epoch and logs
  ``loss_sum / denominator`` and its ``exp``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from nemo.lightning.pytorch.plugins import MegatronDataSampler
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from bert_reduce.lightning.callbacks import ValidationPerplexityCallback

__all__ = [
    "ExactValidationDataSampler",
    "NeMoValidationPerplexityCallback",
    "PaddedEvalDataset",
]


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


class NeMoValidationPerplexityCallback(ValidationPerplexityCallback):
    """:class:`~bert_reduce.lightning.ValidationPerplexityCallback` fed by NeMo 2's reports.

    Add it to ``nl.Trainer(callbacks=[...])``: NeMo's ``MegatronStrategy`` registers trainer
    callbacks with ``MegatronParallel``, which calls ``on_megatron_reduce_microbatches_end``
    with every micro-batch report of a step (on the last pipeline stage). NeMo's own
    ``validation_step`` output, a reduced scalar, is ignored. ``val_loss`` / ``val_ppl`` (the
    keys can be changed) are logged at the end of each validation epoch, the same value on
    every data-parallel rank; NeMo logs its own mean of step means under ``val_loss`` from
    ``validation_step``, and the callback's epoch-end value replaces it in
    ``trainer.callback_metrics`` and loggers. Pipeline parallelism is not supported: the
    other stages hold no reports. Arguments as the Lightning callback's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._collecting = False

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_epoch_start(trainer, pl_module)
        self._collecting = not trainer.sanity_checking

    def on_megatron_reduce_microbatches_end(self, microbatch_outputs: Sequence[Any]) -> None:
        """NeMo's ``MegatronParallel`` hook: the reports of every micro-batch of a step."""
        if self._collecting:
            self.metric.update_from_reports(list(microbatch_outputs))

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """NeMo hands the step's reduced scalar here; the reports came through the hook."""

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collecting = False
        super().on_validation_epoch_end(trainer, pl_module)
