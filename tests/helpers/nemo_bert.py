"""A tiny BERT in real NeMo 2 fits with bert_reduce's loss, and its one-process reference.

Megatron-Core's own ``BertModel`` with tied embeddings, trained by NeMo's ``MegatronStrategy``
on gloo processes (:func:`fit`) and by plain PyTorch in one process on whole global batches
(:func:`reference_training`). Import only where NeMo is.
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import nemo_run as run
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.num_microbatches_calculator import update_num_microbatches
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from nemo import lightning as nl
from nemo.lightning import io
from nemo.lightning.data import WrappedDataLoader
from nemo.lightning.megatron_parallel import default_data_step
from nemo.lightning.pytorch.optim import MegatronOptimizerModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.megatron import output_layer_inputs
from bert_reduce.nemo import (
    ExactValidationDataSampler,
    NeMoValidationPerplexityCallback,
    num_scored_data_step,
)
from examples.nemo2_recipe import mlm_pretrain_recipe
from tests.helpers.dist_utils import load_rank_results, run_launched
from tests.helpers.megatron_bert import CONFIG, build_bert, global_named_parameters, mlm_batch
from tests.helpers.megatron_cpu import megatron_on_cpu, single_process_megatron
from tests.helpers.reference import reference_loss
from tests.helpers.tiny_lightning import RecordingLogger

SEQ_LEN = 12
GLOBAL_BATCH, MICRO_BATCH = 8, 2
# In every global batch, samples 2 and 3 have no masked token: with micro-batches of 2, one
# micro-batch of each step scores nothing (on rank 1 at DP=2, on rank 0 at DP=1).
EMPTY_IN_GLOBAL_BATCH = (2, 3)
LR, MOMENTUM, CLIP_GRAD = 0.5, 0.9, 1.0
STEPS = 3  # optimizer steps of every fit
# Megatron's SGD as reference_training runs it, and the trainer options of every fit.
SGD_OPTIONS = {
    "optimizer": "sgd",
    "lr": LR,
    "sgd_momentum": MOMENTUM,
    "weight_decay": 0.0,
    "clip_grad": CLIP_GRAD,
}
TRAINER_OPTIONS = {
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_checkpointing": False,
}
# Validated after the last step: with the global batch of 8, ExactValidationDataSampler pads
# the 13 samples (one without a masked token) to 16; at DP = 2 the ranks hold 7 and 6 real ones.
VAL_SAMPLES = 13


def tiny_bert_config(**overrides: Any) -> TransformerConfig:
    """``tests.helpers.megatron_bert.CONFIG`` in fp32, with the flag the exact reduction needs."""
    return TransformerConfig(
        **{**CONFIG, "calculate_per_token_loss": True, "pipeline_dtype": torch.float32, **overrides}
    )


class MLMDataset(Dataset):
    """``mlm_batch`` samples; those at ``empty`` modulo ``GLOBAL_BATCH`` score nothing."""

    def __init__(self, num_samples: int, seed: int, empty: tuple[int, ...] = ()) -> None:
        empty_rows = [i for i in range(num_samples) if i % GLOBAL_BATCH in empty]
        self.data = mlm_batch(num_samples, seed, SEQ_LEN, 0.3, empty_rows)
        self.loss_mask = self.data["loss_mask"]

    def __len__(self) -> int:
        return len(self.loss_mask)

    def __getitem__(self, index: int | slice) -> dict[str, Tensor]:
        return {key: value[index] for key, value in self.data.items()}


def train_dataset() -> MLMDataset:
    """:data:`STEPS` global batches, each with an empty micro-batch (``EMPTY_IN_GLOBAL_BATCH``)."""
    return MLMDataset(STEPS * GLOBAL_BATCH, seed=0, empty=EMPTY_IN_GLOBAL_BATCH)


def val_dataset(num_samples: int) -> MLMDataset:
    return MLMDataset(num_samples, seed=1, empty=(1,))


class TinyBertDataModule(pl.LightningDataModule):
    """:func:`train_dataset`; ``validation``: none, or :data:`VAL_SAMPLES` samples in a
    ``"wrapped"`` (NeMo's ``WrappedDataLoader``) or ``"plain"`` loader under
    ``ExactValidationDataSampler``, or (``"nemo_sampler"``) wrapped under NeMo's own sampler."""

    def __init__(self, validation: str | None = None) -> None:
        super().__init__()
        self.validation = validation
        # What NeMo's llm.pretrain checks on a data module.
        self.micro_batch_size, self.global_batch_size = MICRO_BATCH, GLOBAL_BATCH
        self.seq_length = SEQ_LEN
        self.tokenizer = None  # token ids are made here; llm.pretrain hands it to the model
        exact = validation in ("wrapped", "plain")
        sampler = ExactValidationDataSampler if exact else nl.MegatronDataSampler
        self.data_sampler = sampler(
            seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """Samples consumed so far, for resuming (as NeMo's ``PreTrainingDataModule``)."""
        consumed = self.data_sampler.compute_consumed_samples(self.trainer.global_step)
        return {"consumed_samples": consumed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        consumed = state_dict["consumed_samples"]
        self.data_sampler.init_consumed_samples = consumed
        self.data_sampler.prev_consumed_samples = consumed
        update_num_microbatches(consumed_samples=consumed, consistency_check=False)
        self.data_sampler.if_first_step = 1

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(train_dataset(), batch_size=MICRO_BATCH)

    @override
    def val_dataloader(self) -> DataLoader:
        dataset = val_dataset(VAL_SAMPLES if self.validation else 1)
        if self.validation == "plain":
            return DataLoader(dataset, batch_size=MICRO_BATCH)
        # NeMo's data modules mark their loaders' mode; its data samplers read it.
        return WrappedDataLoader(mode="validation", dataset=dataset, batch_size=MICRO_BATCH)


class TinyBertMLM(pl.LightningModule, io.IOMixin):
    """The LightningModule NeMo 2 drives: BERT + bert_reduce's loss, NeMo/BioNeMo-style.

    ``output``, what the last stage hands the loss: ``"logits"`` (NeMo's BERT), ``"lm_loss"``
    (Megatron's per-token losses), or ``"fused"``: in training ``output_layer_inputs``, with
    ``num_scored_data_step``'s count checked to reach the loss as an ``int``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        loss_reduction_class: Callable[..., BERTMLMLossWithReduction] = BERTMLMLossWithReduction,
        output: str = "logits",
    ) -> None:
        super().__init__()
        self.config = config
        self.loss_reduction_class = loss_reduction_class
        self.output = output
        self.module: BertModel | None = None

    @override
    def configure_model(self) -> None:
        if self.module is None:
            self.module = build_bert(self.config, SEQ_LEN)

    @override
    def forward(self, batch: Mapping[str, Tensor]) -> Tensor | dict[str, Tensor]:
        """Hidden states ``[s, b, h]`` on a non-last stage, else the loss's input."""
        assert self.module is not None
        if self.output == "fused" and self.training:
            return output_layer_inputs(self.module, batch["text"], batch["attention_mask"])
        labels = batch["labels"] if self.output == "lm_loss" else None
        out = self.module(batch["text"], batch["attention_mask"], lm_labels=labels)
        if not isinstance(out, tuple):
            return out
        return {"logits" if self.output == "fused" else self.output: out[0]}

    def data_step(self, dataloader_iter: Iterator[Any]) -> dict[str, Tensor]:
        if self.output == "fused":
            return num_scored_data_step(default_data_step)(dataloader_iter)
        return default_data_step(dataloader_iter)

    def forward_step(self, batch: Mapping[str, Tensor], batch_idx: int | None = None) -> Any:
        if self.output == "fused" and self.training:
            count = batch["num_scored"]
            assert type(count) is int and count == int(batch["loss_mask"].sum()), count
        return self(batch)

    # NeMo calls forward_step on earlier pipeline stages, training/validation_step on the last.
    training_step = validation_step = forward_step

    def training_loss_reduction(self) -> BERTMLMLossWithReduction:
        return self.loss_reduction_class()

    def validation_loss_reduction(self) -> BERTMLMLossWithReduction:
        return self.loss_reduction_class(validation_step=True)


@functools.cache
def reference_training(
    adam_lr: float | None = None,
) -> tuple[list[float], dict[str, Tensor], float]:
    """Plain PyTorch, one process: the losses of each step, the final weights and then the
    mean NLL over every masked validation token.

    Each step is one whole global batch: ``F.cross_entropy`` over its masked tokens (fp64 on
    the fp32 logits), backward, ``clip_grad_norm_(CLIP_GRAD)``, ``SGD(LR, MOMENTUM)`` (or, with
    ``adam_lr``, ``torch.optim.AdamW`` with Megatron's default betas and eps and no weight
    decay: what Megatron's ``adam`` is without Apex/TE).
    """
    with single_process_megatron(), megatron_on_cpu():
        model = build_bert(tiny_bert_config(), SEQ_LEN)
        if adam_lr is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        else:
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=adam_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
            )
        data, losses = train_dataset(), []
        for step in range(STEPS):
            loss = _mean_nll(model, data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():
            val_loss = _mean_nll(model, val_dataset(VAL_SAMPLES).data).item()
        params = global_named_parameters(model)
    return losses, {name: p.detach().clone() for name, p in params.items()}, val_loss


def _mean_nll(model: BertModel, batch: dict[str, Tensor]) -> Tensor:
    logits, _ = model(batch["text"], batch["attention_mask"])
    return reference_loss(logits.transpose(0, 1), batch["labels"], batch["loss_mask"])


def assert_matches_reference(results: list[dict[str, Any]], reference: tuple) -> None:
    """Every rank logged the reference's losses and holds its weights (fp32 tolerances)."""
    ref_losses, ref_params = reference[:2]
    seen = set()
    for result in results:
        # Every rank, first pipeline stage included, logged the exact loss of every step.
        torch.testing.assert_close(
            torch.tensor(result["losses"]),
            torch.tensor(ref_losses, dtype=torch.float32),
            rtol=1e-6,
            atol=0,
        )
        for name, value in result["params"].items():
            # The last stage's copy of the tied output weight is the word embedding.
            ref_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
            torch.testing.assert_close(value, ref_params[ref_name], rtol=1e-5, atol=1e-6)
            seen.add(ref_name)
    assert seen == set(ref_params)


class ResultSaver(pl.Callback):
    """Keeps NeMo's logged ``reduced_train_loss`` and its own ``val_loss`` of each validation
    step (logged from ``validation_step``); saves ``<out_dir>/rank<r>.pt``: parameters by
    global name, pipeline and data-parallel ranks, losses (at the end, and on :meth:`save`)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.losses: list[float] = []
        self.step_means: list[float] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["reduced_train_loss"]))

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module, outputs, *args) -> None:
        if not trainer.sanity_checking:
            self.step_means.append(float(outputs))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save(trainer, pl_module)

    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, **extra: Any) -> None:
        bert = next(m for m in pl_module.modules() if isinstance(m, BertModel))
        params = {n: p.detach().clone() for n, p in global_named_parameters(bert).items()}
        result = {
            "params": params,
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "losses": self.losses,
            **extra,
        }
        torch.save(result, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def _fit_body(out_dir: str, world_size: int, pp: int, tp: int, output: str, validation) -> None:
    saver = ResultSaver(out_dir)
    callbacks: list[pl.Callback] = [saver]
    options: dict[str, Any] = {**TRAINER_OPTIONS, "logger": False}
    if validation is not None:
        perplexity, logger = NeMoValidationPerplexityCallback(), RecordingLogger()
        callbacks.append(perplexity)
        options |= {
            "logger": logger,
            "limit_val_batches": None,
            "val_check_interval": STEPS,
            "num_sanity_val_steps": 2,  # Lightning's default: not counted, must not disturb it
        }
    # The Megatron flags the exact per-token reduction needs.
    strategy = nl.MegatronStrategy(
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        ddp=DistributedDataParallelConfig(average_in_collective=False),
        ckpt_load_strictness="log_all",
    )
    trainer = nl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        plugins=nl.MegatronMixedPrecision(precision="32"),
        callbacks=callbacks,
        **options,
    )
    config = tiny_bert_config(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp)
    model = TinyBertMLM(config, output=output)
    sgd = OptimizerConfig(**SGD_OPTIONS, use_distributed_optimizer=False)  # as the reference
    MegatronOptimizerModule(sgd).connect(model)
    extra: dict[str, Any] = {}
    try:
        with megatron_on_cpu():
            trainer.fit(model, TinyBertDataModule(validation))
    except RuntimeError as error:
        if validation is None:
            raise
        extra["error"] = str(error)
    if validation is not None:
        if "error" not in extra:
            assert perplexity.result is not None
            extra["val_result"] = perplexity.result._asdict()
            # ExactValidationDataSampler's RealSampleTracker: this rank's real samples.
            extra["real_on_rank"] = sum(trainer.val_dataloaders.batch_sampler.is_real)
            extra["nemo_step_means"] = saver.step_means
        extra["logged"] = logger.values
        extra["callback_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    saver.save(trainer, model, **extra)


def fit(
    world_size: int, pp: int = 1, tp: int = 1, output: str = "logits", validation=None
) -> list[dict]:
    """Every rank's :class:`ResultSaver` result of a :data:`STEPS`-step fit; with
    ``validation`` also one validation epoch's ``logged`` values and either the callback's
    ``val_result`` (``real_on_rank``, ``nemo_step_means``) or the fit's ``error``."""
    with tempfile.TemporaryDirectory() as out_dir:
        run_launched(_fit_body, world_size, out_dir, world_size, pp, tp, output, validation)
        return load_rank_results(out_dir, world_size)


def assert_exact_validation(results: list[dict[str, Any]]) -> None:
    """Every rank logged the one-pass ``val_loss`` and ``val_ppl`` once, the same values."""
    reference = reference_training()[2]
    mask = val_dataset(VAL_SAMPLES).loss_mask
    values = set()
    for rank in results:
        assert "error" not in rank, rank.get("error")
        assert rank["val_result"]["denominator"].item() == mask.sum().item()
        torch.testing.assert_close(rank["val_result"]["loss"].item(), reference, rtol=1e-6, atol=0)
        # One validation epoch: one value of each reached the logger, and callback_metrics.
        logged = rank["logged"]
        assert len(logged["val_loss"]) == len(logged["val_ppl"]) == 1
        val_loss, val_ppl = logged["val_loss"][0], logged["val_ppl"][0]
        torch.testing.assert_close(val_loss, reference, rtol=1e-6, atol=0)
        torch.testing.assert_close(val_ppl, math.exp(val_loss), rtol=1e-6, atol=0)
        assert rank["callback_metrics"]["val_loss"] == val_loss
        values.add((val_loss, val_ppl))
    assert len(values) == 1  # every rank, every pipeline stage, logged the same values


def recipe(out_dir: str, devices: int) -> run.Partial:
    """``examples/nemo2_recipe.py``'s recipe around :class:`TinyBertMLM`, as the fits run."""
    return mlm_pretrain_recipe(
        model=run.Config(TinyBertMLM, config=run.Config(tiny_bert_config)),
        data=run.Config(TinyBertDataModule),
        devices=devices,
        accelerator="cpu",
        max_steps=STEPS,
        log_dir=str(Path(out_dir) / "nemo_experiments"),
        loss_options={"capacity": "all"},
        optimizer_options=SGD_OPTIONS,
        trainer_options={
            "callbacks": [run.Config(ResultSaver, out_dir=out_dir)],
            "plugins": run.Config(nl.MegatronMixedPrecision, precision="32"),
            **TRAINER_OPTIONS,
        },
    )
