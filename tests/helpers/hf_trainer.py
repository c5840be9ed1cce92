"""Real ``transformers.Trainer`` runs on CPU, 1 or several gloo processes, and their references.

Shared by ``tests/hf``, ``tests/integration/test_hf_exact_trainer.py`` and
``bench/hf_trainer_exactness.py`` (which prints the table of ``docs/hf_trainer.md``). The
references (:func:`reference_step`, :func:`reference_eval`) use nothing from bert_reduce.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from accelerate.utils import memory
from torch import Tensor, nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    EsmForMaskedLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from bert_reduce.hf import ExactMLMTrainer
from tests.helpers.dist_utils import join_existing_group, run_distributed
from tests.helpers.hf_esm import TINY_SIZES, esm_batch, tiny_esm_config
from tests.helpers.reference import reference_loss

SEQ_LEN = 16
# One global batch of 8: heavily masked samples first, an empty last micro-batch for every
# split into 2, 4 or 8 micro-batches (over accumulation steps and processes).
TRAIN_LENGTHS = (16, 14, 12, 15, 10, 9, 13, 11)
TRAIN_MASKED = (11, 9, 7, 5, 3, 1, 0, 0)
# 13 eval samples with uneven masking: eval batch 3 leaves a partial last batch, and over two
# processes the distributed sampler pads it with duplicates.
EVAL_LENGTHS = (16, 9, 14, 12, 16, 7, 11, 15, 10, 13, 8, 16, 12)
EVAL_MASKED = (12, 1, 2, 9, 3, 1, 7, 2, 5, 1, 4, 13, 2)


def tiny_model(kind: str) -> nn.Module:
    """A tiny fp64 ``EsmForMaskedLM`` (``"esm"``) or ``BertForMaskedLM`` (``"bert"``:
    Geneformer's architecture, post-LN, tied head with bias)."""
    torch.manual_seed(0)
    if kind == "esm":
        model = EsmForMaskedLM(tiny_esm_config())
    elif kind == "bert":
        model = BertForMaskedLM(BertConfig(vocab_size=40, pad_token_id=0, **TINY_SIZES))
    else:
        raise ValueError(kind)
    model = model.double()
    with torch.no_grad():  # non-zero biases, so that a bias the loss dropped would show
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def samples(
    lengths: Sequence[int], masked: Sequence[int], seed: int = 0
) -> list[dict[str, Tensor]]:
    """One dict per sample: ``input_ids``, ``attention_mask``, ``labels`` of length SEQ_LEN."""
    batch = esm_batch(list(lengths), SEQ_LEN, list(masked), seed=seed)
    return [{key: value[row] for key, value in batch.items()} for row in range(len(lengths))]


def stack(rows: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def cross_entropy_mean(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Mean ``F.cross_entropy`` of ``model`` over the labelled (``!= -100``) tokens of the
    ``[b, s]`` ``batch`` in one pass; 0 if there are none."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return reference_loss(logits.transpose(0, 1), batch["labels"], batch["labels"] != -100)


def reference_step(kind: str) -> dict[str, Any]:
    """Gradient and loss of one process on the whole unsplit global batch of 8."""
    model = tiny_model(kind).train()
    loss = cross_entropy_mean(model, stack(samples(TRAIN_LENGTHS, TRAIN_MASKED)))
    loss.backward()
    return {"grads": grads(model), "loss": loss.item()}


def reference_eval(kind: str, rows: Sequence[dict[str, Tensor]]) -> float:
    """Mean cross-entropy over every masked token of the eval set, in one pass."""
    with torch.no_grad():
        return cross_entropy_mean(tiny_model(kind).eval(), stack(rows)).item()


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {
        name: param.grad.detach().clone()
        for name, param in model.named_parameters()
        if param.grad is not None
    }


def relative_error(grads: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    """``||g - g_ref|| / ||g_ref||`` over every parameter (a missing gradient counts as 0)."""
    names = set(grads) | set(reference)
    difference = torch.stack([(grads.get(n, 0) - reference.get(n, 0)).norm() for n in names])
    return float(difference.norm() / torch.stack([r.norm() for r in reference.values()]).norm())


def norm_ratio(grads: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    norm = torch.cat([g.reshape(-1) for g in grads.values()]).norm()
    return float(norm / torch.cat([g.reshape(-1) for g in reference.values()]).norm())


@dataclasses.dataclass(frozen=True)
class Case:
    """One Trainer run: which model and trainer, how the global batch of 8 is split."""

    kind: str  # "esm" | "bert"
    exact: bool  # ExactMLMTrainer, else transformers.Trainer
    accumulation: int = 1
    average_tokens: bool = True  # TrainingArguments.average_tokens_across_devices
    sampling: str = "sequential"  # TrainingArguments.train_sampling_strategy
    seed: int = 0
    fused_head: bool = False
    with_metrics: bool = False  # evaluation: a compute_metrics that needs the logits


def training_arguments(output_dir: str, **overrides: Any):
    values: dict[str, Any] = {
        "output_dir": output_dir,
        "use_cpu": True,
        "learning_rate": 0.0,
        "max_grad_norm": 0.0,  # the gradient is read after clipping: none
        "max_steps": 1,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "train_sampling_strategy": "sequential",  # the heavily masked samples first
    }
    if dist.is_initialized():
        # With one process accelerate must get no backend (it would look for a process group).
        values["ddp_backend"] = "gloo"
    values.update(overrides)
    return TrainingArguments(**values)


def _trainer(case: Case, output_dir: str, **kwargs: Any):
    """The case's trainer, keeping the loss ``training_step`` and ``prediction_step`` return for
    each (micro-)batch."""
    if case.exact:
        kwargs["fused_head"] = case.fused_head

    class Recording(ExactMLMTrainer if case.exact else Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.micro_batch_losses = [*getattr(self, "micro_batch_losses", []), loss.item()]
            return loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, *rest = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            self.batch_losses = [*getattr(self, "batch_losses", []), loss.item()]
            return loss, *rest

    return Recording(model=tiny_model(case.kind), **kwargs)


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def step_gradient(trainer) -> dict[str, Tensor]:
    """``trainer.train()``; the gradient of its (one) optimizer step, after DDP's all-reduce."""
    captured: dict[str, dict[str, Tensor]] = {}

    class GradientAtStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            captured["grads"] = grads(model)

    trainer.add_callback(GradientAtStep())
    trainer.train()
    return captured["grads"]


def trainer_step(case: Case, output_dir: str) -> dict[str, Any]:
    """One optimizer step (lr 0) on the global batch of 8 over this process group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    args = training_arguments(
        output_dir,
        per_device_train_batch_size=8 // (world * case.accumulation),
        gradient_accumulation_steps=case.accumulation,
        average_tokens_across_devices=case.average_tokens,
        train_sampling_strategy=case.sampling,
        seed=case.seed,
    )
    rows = samples(TRAIN_LENGTHS, TRAIN_MASKED)
    trainer = _trainer(case, output_dir, args=args, train_dataset=rows)
    return {
        "grads": step_gradient(trainer),
        "loss": logged_losses(trainer)[0],
        "micro_batch_losses": trainer.micro_batch_losses,
    }


def trainer_eval(case: Case, output_dir: str) -> dict[str, Any]:
    """``evaluate()`` over the 13 eval samples with eval batch 3."""
    rows = samples(EVAL_LENGTHS, EVAL_MASKED, seed=1)
    seen: dict[str, Any] = {}

    def compute_metrics(prediction) -> dict[str, float]:
        logits, labels = prediction.predictions, prediction.label_ids
        seen["shapes"] = (tuple(logits.shape), tuple(labels.shape))
        scored = labels != -100
        accuracy = float((logits.argmax(-1)[scored] == labels[scored]).mean())
        return {"masked_accuracy": accuracy}

    args = training_arguments(output_dir, per_device_eval_batch_size=3)
    trainer = _trainer(
        case,
        output_dir,
        args=args,
        eval_dataset=rows,
        compute_metrics=compute_metrics if case.with_metrics else None,
    )
    metrics = trainer.evaluate()
    return {
        "metrics": metrics,
        "metric_shapes": seen.get("shapes"),
        "batch_losses": trainer.batch_losses,
    }


@contextlib.contextmanager
def fast_cpu_runs() -> Iterator[None]:
    """Run torch on one thread and skip the ``gc.collect()`` that ends every ``train()``.

    These tiny models run several times faster on a busy machine with one thread than with
    two fighting for its cores; and Trainer's ``accelerator.free_memory()`` after training
    collects the garbage of the whole test session, most of a short run's time.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.object(memory, "clear_device_cache", lambda garbage_collection=False: None):
            yield
    finally:
        torch.set_num_threads(threads)


Job = tuple[str, Case]
"""A runner's name (``"trainer_step"`` or ``"trainer_eval"``) and its case."""


def _run_all(jobs: Sequence[Job], output_dir: str, result_path: str | None) -> list[dict]:
    """Each job's result; with ``result_path``, on a gloo process whose rank 0 saves them there
    (OMP_NUM_THREADS stops accelerate resizing torch's thread pool)."""
    if result_path is not None:
        join_existing_group()
        os.environ["OMP_NUM_THREADS"] = "1"
    results = []
    with fast_cpu_runs():
        for index, (runner_name, case) in enumerate(jobs):
            runner: Callable[[Case, str], dict[str, Any]] = globals()[runner_name]
            results.append(runner(case, os.path.join(output_dir, str(index))))
    if result_path is not None and dist.get_rank() == 0:
        torch.save(results, result_path)
    return results


def run_jobs(jobs: Sequence[Job], processes: int = 1) -> list[dict[str, Any]]:
    """Each job's result, from this process or from ``processes`` spawned gloo processes.

    With ``processes > 1``, all jobs run in one pair of processes, one after the other (the
    imports are paid once); rank 0's results come back.
    """
    with tempfile.TemporaryDirectory() as tmp:
        if processes == 1:
            return _run_all(jobs, tmp, None)
        path = os.path.join(tmp, "results.pt")
        run_distributed(_run_all, processes, list(jobs), tmp, path, megatron=False)
        return torch.load(path, weights_only=False)


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference) if reference else math.inf
