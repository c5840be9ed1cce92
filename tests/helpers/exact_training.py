"""A tiny MLM, a dataset with uneven masks, an independent reference loop and Lightning runs.

The reference is plain PyTorch in one process: ``F.cross_entropy`` over every masked token of
the whole global batch, one backward, the same optimizer. Nothing from bert_reduce is used there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, default_collate

from bert_reduce.functional import safe_divide
from bert_reduce.lightning import ExactMLMModule, GlobalBatchSampler, ShardedEvalBatchSampler
from bert_reduce.num_scored import NumScoredCollator
from bert_reduce.reduction import BERTMLMLossWithReduction
from tests.helpers.dist_utils import full, join_existing_group
from tests.helpers.reference import assert_close_by_name, reference_loss
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs
from tests.helpers.tiny_lightning import quiet_trainer

VOCAB = 11
MASK_ID = VOCAB - 1
SEQ_LEN = 6
GLOBAL_BATCH = 8
# Masked tokens per sample. With GLOBAL_BATCH=8 in order: step 0 has empty samples 2-3 (an
# empty micro-batch for micro_batch_size <= 2), step 2 gives rank 0 of 2 no masked token at all.
MASK_COUNTS = (3, 1, 0, 0, 5, 2, 6, 1, 2, 0, 4, 6, 1, 1, 3, 0, 0, 0, 0, 0, 6, 2, 1, 5)
STEPS = len(MASK_COUNTS) // GLOBAL_BATCH
VAL_SEED = 1
CONSTANT_PER_SEQUENCE = SEQ_LEN

ParamDict = dict[str, Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class TinyMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        dim = 8
        self.embed = nn.Embedding(VOCAB, dim)
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim * SEQ_LEN, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        x = self.norm(self.embed(batch["input_ids"]))  # [b, s, d]
        context = self.mix(x.flatten(1)).unsqueeze(1)  # [b, 1, d]: every token sees the row
        logits = self.head(torch.tanh(x + context))  # [b, s, v]
        return {"token_logits": logits.transpose(0, 1)}  # [s, b, v]


class MLMSamples(Dataset[dict[str, Tensor]]):
    """The first ``size`` samples, masked ``MASK_COUNTS`` times: ``input_ids`` (``MASK_ID`` where
    masked), ``labels`` (-100 where unscored), ``loss_mask``."""

    def __init__(self, size: int = len(MASK_COUNTS), seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, MASK_ID, (len(MASK_COUNTS), SEQ_LEN), generator=gen)[:size]
        masks = torch.zeros(len(MASK_COUNTS), SEQ_LEN, dtype=torch.bool)
        for row, count in enumerate(MASK_COUNTS):
            masks[row, torch.randperm(SEQ_LEN, generator=gen)[:count]] = True
        self.loss_mask = masks[:size]
        self.input_ids = torch.where(self.loss_mask, MASK_ID, tokens)
        self.labels = torch.where(self.loss_mask, tokens, -100)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def __getitem__(self, index: int | slice) -> dict[str, Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "loss_mask": self.loss_mask[index],
        }


def initial_model() -> TinyMLM:
    torch.manual_seed(1)
    return TinyMLM().double()


SGD: OptimizerFactory = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
ADAMW: OptimizerFactory = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)


def reference_train(
    optimizer: OptimizerFactory, clip: float | None, mode: str = "per_token"
) -> tuple[ParamDict, list[float]]:
    model = initial_model()
    opt = optimizer(model.parameters())
    dataset = MLMSamples()
    losses = []
    for step in range(STEPS):
        batch = dataset[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        logits, mask = model(batch)["token_logits"], batch["loss_mask"]
        loss = reference_loss(
            logits, batch["labels"], mask, mode, constant_per_sequence=CONSTANT_PER_SEQUENCE
        )
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


class _Record(pl.Callback):
    """Logged train_loss per step; validation reports summed over this rank's batches."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_totals = torch.zeros(2, dtype=torch.float64)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: dict, *args: object
    ) -> None:
        self.val_totals += outputs["loss_sum_and_microbatch_size"]


class InstrumentedModule(ExactMLMModule):
    """Counts collectives and forbids host syncs inside every training step."""

    collectives_per_step: list[dict[str, int]]

    def on_fit_start(self) -> None:
        super().on_fit_start()
        # Lightning registers DDP communication hooks on CUDA only; on CPU, do it here.
        ddp = self.trainer.strategy.model
        assert isinstance(ddp, DistributedDataParallel)
        ddp.register_comm_hook(None, counting_allreduce_hook)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        with count_collectives() as counts, forbid_host_syncs():
            loss = super().training_step(batch, batch_idx)
        self.collectives_per_step.append(dict(counts))
        return loss


class CountRecordingLoss(BERTMLMLossWithReduction):
    """The loss, recording the ``num_scored`` and ``loss_mask`` of every micro-batch it scores."""

    seen: ClassVar[list[tuple[object, Tensor]]] = []

    def forward(self, batch, forward_out):
        CountRecordingLoss.seen.append((batch.get("num_scored"), batch["loss_mask"].clone()))
        return super().forward(batch, forward_out)


def assert_each_loss_got_its_micro_batch_count() -> None:
    """Every micro-batch reached the loss with its own count of scored positions, an int."""
    assert CountRecordingLoss.seen
    for count, mask in CountRecordingLoss.seen:
        assert type(count) is int and count == int(mask.sum()), (count, mask)


GRADIENT_BUCKETS_REDUCED: list[int] = []


def counting_allreduce_hook(state, bucket):  # DDP checks unstringified annotations: none here
    """DDP's default gradient all-reduce (sum, then divide by world size), counted."""
    GRADIENT_BUCKETS_REDUCED.append(bucket.index())
    return default_hooks.allreduce_hook(state, bucket)


class StockAccumulationModule(pl.LightningModule):
    """What Lightning does out of the box: a mean loss per micro-batch, accumulate_grad_batches."""

    def __init__(self, model: nn.Module, optimizer: OptimizerFactory) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.loss_fn = BERTMLMLossWithReduction()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.loss_fn.setup(batch)
        loss_sum, num_tokens, _ = self.loss_fn(self.model(batch))
        return safe_divide(loss_sum, num_tokens)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())


@dataclasses.dataclass
class Run:
    params: ParamDict
    losses: list[float]
    val_totals: Tensor
    module: pl.LightningModule


def lightning_train(
    *,
    micro_batch_size: int,
    optimizer: OptimizerFactory = SGD,
    clip: float | None = None,
    strategy: str | DDPStrategy = "auto",
    devices: int = 1,
    stock: bool = False,
    module_cls: type[ExactMLMModule] = ExactMLMModule,
    mode: str = "per_token",
    precision: str = "64-true",
    val_size: int = 0,
    model_dtype: torch.dtype | None = None,
    count_scored: bool = False,
) -> Run:
    """Train with Lightning, then validate on the first ``val_size`` validation samples.

    The model is fp64 under ``"64-true"``, else fp32, unless ``model_dtype`` says otherwise
    (``ModelParallelStrategy`` refuses ``"64-true"``: an fp64 model under ``"32-true"``).
    With ``count_scored``, the training loader adds per-sample ``num_scored`` counts
    (``NumScoredCollator``) and the loss is a :class:`CountRecordingLoss` (reset here).
    """
    if model_dtype is None:
        model_dtype = torch.float64 if precision == "64-true" else torch.float32
    model = initial_model().to(model_dtype)
    dataset = MLMSamples()
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, micro_batch_size, shuffle=False)
    val_loader = DataLoader(
        MLMSamples(seed=VAL_SEED), batch_sampler=ShardedEvalBatchSampler(val_size, 2)
    )
    recorder = _Record()
    common = {
        "devices": devices,
        "strategy": strategy,
        "max_steps": STEPS,
        "precision": precision,
        "use_distributed_sampler": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 1.0 if val_size else 0,
    }
    module: pl.LightningModule
    if stock:
        module = StockAccumulationModule(model, optimizer)
        n = micro_batch_size  # Lightning accumulates the micro-batches of each share
        batches = [share[i : i + n] for share in sampler for i in range(0, len(share), n)]
        loader = DataLoader(dataset, batch_sampler=batches)
        trainer = quiet_trainer(
            accumulate_grad_batches=sampler.share // micro_batch_size,
            gradient_clip_val=clip,
            **common,
        )
    else:
        loss_cls = CountRecordingLoss if count_scored else BERTMLMLossWithReduction
        CountRecordingLoss.seen = []
        loss_fn = loss_cls(
            normalization=mode,
            constant_per_sequence=CONSTANT_PER_SEQUENCE if mode == "constant" else None,
        )
        module = module_cls(
            model, micro_batch_size, optimizer=optimizer, loss_fn=loss_fn, gradient_clip_val=clip
        )
        collate = NumScoredCollator(default_collate, per_sample=True) if count_scored else None
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
        trainer = quiet_trainer([recorder], **common)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val_loader)
    assert (trainer.global_step, trainer.world_size) == (STEPS, devices)
    params = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    return Run(params, recorder.losses, recorder.val_totals, module)


def existing_group(strategy: str) -> DDPStrategy | ModelParallelStrategy:
    """``"ddp"`` or ``"fsdp2"`` over the process group ``dist_utils.run_distributed`` made."""
    join_existing_group()
    if strategy == "ddp":
        return DDPStrategy(cluster_environment=LightningEnvironment(), process_group_backend="gloo")
    fsdp2 = ModelParallelStrategy(
        data_parallel_size=dist.get_world_size(),
        tensor_parallel_size=1,
        process_group_backend="gloo",
    )
    fsdp2.cluster_environment = LightningEnvironment()
    return fsdp2


def assert_params_close(actual: ParamDict, expected: ParamDict) -> None:
    assert_close_by_name(actual, expected, rtol=1e-10, atol=1e-12)


def assert_trains_as_reference(
    run: Run, optimizer: OptimizerFactory = SGD, mode: str = "per_token"
) -> None:
    """``run``'s parameters and logged losses are :func:`reference_train`'s (no clipping)."""
    expected, expected_losses = reference_train(optimizer, clip=None, mode=mode)
    assert_params_close(run.params, expected)
    torch.testing.assert_close(run.losses, expected_losses, rtol=1e-12, atol=0)


def max_param_difference(actual: ParamDict, expected: ParamDict) -> float:
    return max((actual[k] - expected[k]).abs().max().item() for k in expected)
