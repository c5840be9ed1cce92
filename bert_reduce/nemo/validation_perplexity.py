"""Exact ``val_loss`` / ``val_ppl`` under NeMo 2, from the reports NeMo hands its callbacks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from nemo.lightning.megatron_parallel import MegatronStep
from torch import Tensor
from typing_extensions import override

from bert_reduce.distributed import all_reduce_sum_
from bert_reduce.lightning.validation_perplexity import ValidationPerplexityCallback
from bert_reduce.nemo.validation_data import RealSampleTracker


class NeMoValidationPerplexityCallback(ValidationPerplexityCallback):
    """:class:`~bert_reduce.lightning.ValidationPerplexityCallback` fed by NeMo 2's reports.

    Add it to ``nl.Trainer(callbacks=[...])``; what every rank logs, and when it refuses to:
    ``docs/nemo.md``, "Exact validation loss and perplexity". Arguments as the Lightning
    callback's.

    Raises:
        ValueError: At the start of a validation epoch, if there is not exactly one
            validation dataloader with a dataset of known length.
        RuntimeError: At the end of a validation epoch (before anything is logged), naming
            both counts, if the summed reports do not cover every sample of the validation
            set exactly once (the causes: ``docs/nemo.md``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._collecting = False
        self._samples_summed = 0
        self._tracker: RealSampleTracker | None = None
        self._set_size = 0

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_epoch_start(trainer, pl_module)
        self._collecting = not trainer.sanity_checking
        self._samples_summed = 0
        if self._collecting:
            loader = _the_validation_loader(trainer.val_dataloaders)
            tracker = getattr(loader, "batch_sampler", None)
            self._tracker = tracker if isinstance(tracker, RealSampleTracker) else None
            self._set_size = len(loader.dataset) if self._tracker is None else tracker.num_real

    def on_megatron_reduce_microbatches_end(
        self, step: MegatronStep, microbatch_outputs: Sequence[Any]
    ) -> None:
        """NeMo's ``MegatronParallel`` hook: the reports of every micro-batch of a step."""
        if self._collecting:
            self.metric.update_from_reports(list(microbatch_outputs))
            self._samples_summed += len(microbatch_outputs) * step.micro_batch_size

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """NeMo hands the step's reduced scalar here; the reports came through the hook."""

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collecting = False
        super().on_validation_epoch_end(trainer, pl_module)

    @override
    def _epoch_totals(self, trainer: pl.Trainer) -> tuple[Tensor, Tensor]:
        # Sums over data x context parallel ranks of each stage (zeros but on the last stage).
        loss_sum, denominator = super()._epoch_totals(trainer)
        if self._tracker is None:
            real_seen = self._samples_summed  # no padding: every dealt sample is real
        else:
            real_seen = self._tracker.real_samples_in_first(self._samples_summed)
        seen = torch.tensor(float(real_seen), dtype=torch.float64, device=loss_sum.device)
        megatron = parallel_state.model_parallel_is_initialized()
        if megatron:
            # Context-parallel ranks share their samples: count over data-parallel ranks only.
            all_reduce_sum_(seen, parallel_state.get_data_parallel_group())
        totals = torch.stack([loss_sum, denominator, seen])
        if megatron and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # The reports live on the last stage: every stage takes its totals.
            dist.broadcast(
                totals,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        # One host read per epoch, to raise before anything is logged.
        _check_every_sample_once(int(totals[2].item()), self._set_size)
        return totals[0], totals[1]


def _the_validation_loader(loaders: Any) -> Any:
    """The one validation dataloader of ``trainer.val_dataloaders``."""
    # By hand, not CombinedLoader(...).flattened, which turns an empty list into one "loader".
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif not isinstance(loaders, list | tuple):
        loaders = [] if loaders is None else [loaders]
    if len(loaders) != 1 or not hasattr(loaders[0], "dataset"):
        raise ValueError(
            "NeMoValidationPerplexityCallback needs exactly one validation dataloader with a "
            f"map-style dataset (NeMo's micro-batch reports do not say which loader they come "
            f"from); val_dataloader() returned {len(loaders)}: "
            f"{[type(loader).__name__ for loader in loaders]}."
        )
    return loaders[0]


def _check_every_sample_once(seen: int, set_size: int) -> None:
    """Raise ``RuntimeError`` unless ``seen`` real samples make up the whole validation set."""
    if seen == set_size:
        return
    if seen < set_size:
        why = (
            f"{set_size - seen} samples were not seen: NeMo's MegatronDataSampler drops the "
            "last partial global batch of the validation set (use "
            "bert_reduce.nemo.ExactValidationDataSampler as the data module's data_sampler), "
            "or Trainer(limit_val_batches=...) cut the epoch short (leave it at 1.0)."
        )
    else:
        why = f"{seen - set_size} samples were counted twice: a sampler repeated samples."
    raise RuntimeError(
        f"NeMoValidationPerplexityCallback: the reports of this validation epoch cover {seen} "
        f"real samples (over all data-parallel ranks), but the validation set has {set_size}; "
        f"val_loss and val_ppl would not be those of the validation set. {why}"
    )
