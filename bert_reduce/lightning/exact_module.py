"""A LightningModule whose optimizer step is exactly that of the whole global batch.

How: ``docs/lightning.md``, "What one step does"; the algebra: ``docs/guarantees.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

from bert_reduce import distributed
from bert_reduce.functional import safe_divide
from bert_reduce.num_scored import NUM_SCORED_KEY
from bert_reduce.reduction import BERTMLMLossWithReduction, MegatronLossReduction
from bert_reduce.reports import make_report
from bert_reduce.sampling import check_sampler_placement

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]
"""Builds the optimizer from the parameters, e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``
(Hydra: ``_partial_: true``)."""

LRSchedulerFactory = Callable[[Optimizer], LRScheduler]
"""Builds a learning-rate scheduler stepped once per optimizer step."""


def split_micro_batches(batch: Mapping[str, Any], micro_batch_size: int) -> list[dict[str, Any]]:
    """Cut a ``[b, ...]`` batch into consecutive micro-batches of ``micro_batch_size`` samples.

    Every tensor is split along dim 0; other values are shared by all micro-batches, except
    ``num_scored``: per-sample counts become each micro-batch's ``int`` total
    (``docs/lightning.md``). Only shapes and host ints are read: no device sync.

    Args:
        batch: This rank's share of the global batch, e.g. ``input_ids``, ``labels`` and
            ``loss_mask`` of shape ``[b, s]``, optionally ``num_scored``.
        micro_batch_size: Samples per micro-batch; must divide ``b``.

    Returns:
        ``b // micro_batch_size`` dicts with the same keys, in order.

    Raises:
        ValueError: If the batch holds no tensor, a tensor is 0-dim, the tensors disagree on
            ``b``, ``b`` is not a multiple of ``micro_batch_size``, or ``num_scored`` is a
            whole batch's ``int`` to split into several micro-batches, or holds per-sample
            counts for another number of samples.

    Example:
        >>> batch = {"labels": torch.zeros(4, 3), "num_scored": (1, 2, 0, 3)}
        >>> [mb["num_scored"] for mb in split_micro_batches(batch, 2)]
        [3, 3]
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
    tensors = {key: value for key, value in batch.items() if isinstance(value, Tensor)}
    if not tensors:
        raise ValueError(f"The batch holds no tensor to split; its keys are {sorted(batch)}.")
    scalars = sorted(key for key, value in tensors.items() if value.dim() == 0)
    if scalars:
        raise ValueError(f"Cannot split 0-dim tensors batch{scalars} into micro-batches.")
    batch_sizes = {key: value.size(0) for key, value in tensors.items()}
    batch_size = next(iter(batch_sizes.values()))
    if any(size != batch_size for size in batch_sizes.values()):
        raise ValueError(
            "The batch's tensors disagree on the batch dim (dim 0): "
            f"{dict(sorted(batch_sizes.items()))}."
        )
    if batch_size % micro_batch_size != 0:
        raise ValueError(
            f"This rank's batch holds {batch_size} samples, not a multiple of "
            f"micro_batch_size={micro_batch_size}. Each training batch must be this rank's share "
            "of one global batch: build the loader with bert_reduce.lightning.GlobalBatchSampler."
        )
    chunks = {key: value.split(micro_batch_size) for key, value in tensors.items()}
    count = batch_size // micro_batch_size
    num_scored = batch.get(NUM_SCORED_KEY)
    if isinstance(num_scored, tuple | list):  # host per-sample counts: summed into ints
        if len(num_scored) != batch_size:
            raise ValueError(
                f"batch['num_scored'] holds {len(num_scored)} per-sample counts for a batch of "
                f"{batch_size} samples."
            )
        chunks[NUM_SCORED_KEY] = [
            sum(num_scored[start : start + micro_batch_size])
            for start in range(0, batch_size, micro_batch_size)
        ]
    elif NUM_SCORED_KEY in batch and NUM_SCORED_KEY not in chunks and count > 1:
        # A whole batch's count (a tensor is split already) cannot be split.
        raise ValueError(
            f"batch['num_scored'] = {num_scored!r} counts the whole batch of {batch_size} "
            f"samples and cannot be split into {count} micro-batches: give per-sample counts "
            "instead (bert_reduce.num_scored.NumScoredCollator(collate_fn, per_sample=True))."
        )
    return [
        {key: chunks[key][i] if key in chunks else value for key, value in batch.items()}
        for i in range(count)
    ]


@contextlib.contextmanager
def _without_fsdp2_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate FSDP2 gradients locally, without a reduce-scatter."""
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in sharded:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.set_requires_gradient_sync(True, recurse=False)


class ExactMLMModule(pl.LightningModule):
    """Masked-language-model training whose every step is exact for the whole global batch.

    Each ``training_step`` receives this rank's contiguous share of one global batch (see
    :class:`bert_reduce.lightning.GlobalBatchSampler`) and performs one optimizer step, that
    of a single process on the whole global batch. The Trainer's settings, and what one step
    does: ``docs/lightning.md``. Override :meth:`forward` or :meth:`micro_batches` to change
    them. Logged once per step: ``train_loss``, the global batch's loss.

    Args:
        model: Maps a micro-batch dict to a mapping with ``token_logits`` of shape ``[s, b, v]``.
        micro_batch_size: Samples per forward/backward pass.
        optimizer: Builds the optimizer from ``self.parameters()``; ``None`` means a subclass
            overrides :meth:`configure_optimizers`.
        lr_scheduler: Builds a scheduler from the optimizer, stepped after every optimizer step.
        loss_fn: Training loss (a :class:`bert_reduce.MegatronLossReduction`: ``setup(batch)``,
            then ``(numerator, denominator, report)``); ``BERTMLMLossWithReduction()`` by
            default, e.g. ``BERTMLMLossWithReduction(normalization="per_sequence")``.
        val_loss_fn: Validation loss, same contract; by default per-token whatever the training
            normalization (``BERTMLMLossWithReduction(validation_step=True)``).
        gradient_clip_val: Clip the exact global gradient to this norm (or value); ``None``
            disables clipping.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.

    Raises:
        ValueError: On a non-positive ``micro_batch_size`` or an unknown clip algorithm.

    Example:
        >>> module = ExactMLMModule(torch.nn.Identity(), micro_batch_size=2)
        >>> [mb["labels"].shape for mb in module.micro_batches({"labels": torch.zeros(4, 3)})]
        [torch.Size([2, 3]), torch.Size([2, 3])]
    """

    def __init__(
        self,
        model: nn.Module,
        micro_batch_size: int,
        optimizer: OptimizerFactory | None = None,
        lr_scheduler: LRSchedulerFactory | None = None,
        loss_fn: MegatronLossReduction | None = None,
        val_loss_fn: MegatronLossReduction | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
    ) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(
                "gradient_clip_algorithm must be 'norm' or 'value', got "
                f"{gradient_clip_algorithm!r}."
            )
        self.automatic_optimization = False
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.loss_fn = BERTMLMLossWithReduction() if loss_fn is None else loss_fn
        self.val_loss_fn = (
            BERTMLMLossWithReduction(validation_step=True) if val_loss_fn is None else val_loss_fn
        )
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm

    @override
    def forward(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """The model's outputs for one micro-batch: ``token_logits`` of shape ``[s, b, v]``."""
        return self.model(batch)

    def micro_batches(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """This rank's share of the global batch cut into micro-batches.

        See :func:`split_micro_batches`; override to split differently.
        """
        return split_micro_batches(batch, self.micro_batch_size)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        """The optimizer from ``optimizer``, with the scheduler stepped per optimizer step.

        Raises:
            ValueError: If no ``optimizer`` factory was given and no subclass overrides this.
        """
        if self.optimizer_factory is None:
            raise ValueError(
                "ExactMLMModule needs an optimizer: pass optimizer=functools.partial("
                "torch.optim.AdamW, lr=...) or override configure_optimizers()."
            )
        optimizer = self.optimizer_factory(self.parameters())
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    @override
    def on_fit_start(self) -> None:
        """Refuse strategies and precisions under which the step would not be exact.

        Raises:
            ValueError: On a strategy other than DDP, ModelParallelStrategy (FSDP2) or
                single-device, or ``"16-mixed"`` with gradient clipping.
        """
        strategy = self.trainer.strategy
        if not isinstance(strategy, DDPStrategy | ModelParallelStrategy | SingleDeviceStrategy):
            raise ValueError(
                f"ExactMLMModule supports DDPStrategy, ModelParallelStrategy and "
                f"SingleDeviceStrategy, got "
                f"{type(strategy).__name__}: its gradient synchronization is not the one this "
                "module rescales."
            )
        if self.gradient_clip_val is not None and getattr(
            self.trainer.precision_plugin, "scaler", None
        ):
            raise ValueError(
                "gradient_clip_val with precision='16-mixed' would clip loss-scaled gradients; "
                "use precision='bf16-mixed' or disable clipping."
            )

    @override
    def on_train_start(self) -> None:
        """Check that the training sampler hands this rank its own share of each global batch.

        Raises:
            ValueError: See :func:`bert_reduce.sampling.check_sampler_placement`.
        """
        loaders = CombinedLoader(self.trainer.train_dataloader).flattened
        check_sampler_placement(loaders, self.trainer.world_size, self.trainer.global_rank)

    @override
    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``, shard the model with FSDP2 over data-parallel ranks.

        One ``fully_shard`` unit over ``device_mesh["data_parallel"]``; nothing under other
        strategies or when the model is already sharded. Override for finer units.
        """
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        if any(isinstance(module, FSDPModule) for module in self.model.modules()):
            return
        fully_shard(self.model, mesh=self.trainer.strategy.device_mesh["data_parallel"])

    def _local_gradient_accumulation(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        # Lightning's manual optimization prepares DDP's reducer in every manual_backward unless
        # DDP is in no_sync, and FSDP2 reduce-scatters in every backward unless told not to:
        # all micro-batches but the last only accumulate locally.
        strategy = self.trainer.strategy
        if last:
            return contextlib.nullcontext()
        if isinstance(strategy, ModelParallelStrategy):
            return _without_fsdp2_gradient_sync(self.model)
        if isinstance(strategy, DDPStrategy):
            return strategy.block_backward_sync()
        return contextlib.nullcontext()

    @override
    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        """One optimizer step on this rank's share of one global batch.

        Args:
            batch: This rank's contiguous share of the global batch: ``labels`` and
                ``loss_mask`` of shape ``[b, s]`` plus whatever the model reads; ``b`` must be
                a multiple of ``micro_batch_size``.
            batch_idx: Index of the global batch in the epoch.

        Returns:
            The 0-dim fp64 loss of the global batch (detached), as logged in ``train_loss``.
        """
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        micro_batches = self.micro_batches(batch)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for index, micro_batch in enumerate(micro_batches):
            with self._local_gradient_accumulation(last=index == len(micro_batches) - 1):
                forward_out = self(micro_batch)
                self.loss_fn.setup(micro_batch)
                numerator, denominator, _ = self.loss_fn(forward_out)
                self.manual_backward(numerator)
            totals += make_report(numerator, denominator)
        # The group the loss sums over and the number of ranks gradients are averaged over.
        strategy = self.trainer.strategy
        group, dp_size = distributed.loss_reduction_group(), 1
        if isinstance(strategy, ModelParallelStrategy):
            mesh = strategy.device_mesh["data_parallel"]
            group, dp_size = mesh.get_group(), mesh.size()
        elif isinstance(strategy.model, DistributedDataParallel):
            dp_size = dist.get_world_size(strategy.model.process_group)
        distributed.all_reduce_sum_(totals, group)
        global_numerator, global_denominator = totals.unbind()
        # grad = dp_size * sum_local(d numerator) averaged over ranks / global_denominator
        scale = safe_divide(torch.full_like(global_denominator, dp_size), global_denominator)
        # A DTensor gradient (FSDP2) is scaled through its local shard: the scale is the same
        # on every rank, so scaling each shard scales the whole gradient.
        for grad in (param.grad for param in self.parameters() if param.grad is not None):
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale.to(grad.dtype))
        if self.gradient_clip_val is not None:
            self.clip_gradients(
                optimizer,
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
            )
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()  # type: ignore[union-attr]
        train_loss = safe_divide(global_numerator, global_denominator)
        self.log(
            "train_loss", train_loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=1
        )
        return train_loss

    @override
    def validation_step(
        self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Any]:
        """The validation loss report of one micro-batch; nothing is reduced or logged here.

        No collective: ranks may hold different numbers of batches; a callback reduces the
        reports (:class:`bert_reduce.lightning.ValidationPerplexityCallback`).

        Args:
            batch: One validation micro-batch: ``labels`` and ``loss_mask`` of shape ``[b, s]``
                plus whatever the model reads.
            batch_idx: Index of the batch on this rank.
            dataloader_idx: Index of the validation dataloader.

        Returns:
            The validation loss's report (``loss_sum_and_microbatch_size``:
            :mod:`bert_reduce.reports`), plus ``batch`` and ``forward_out`` when it sends them.
        """
        forward_out = self(batch)
        self.val_loss_fn.setup(batch)
        _, _, report = self.val_loss_fn(forward_out)
        return dict(report)
