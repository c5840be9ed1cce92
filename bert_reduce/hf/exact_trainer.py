"""``transformers.Trainer`` with the exact masked-LM loss of every global batch and eval set.

Why and how: ``docs/hf_trainer.md``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from bert_reduce import distributed
from bert_reduce.engine import LossOptions, loss_terms, mode_terms, scored_weights, token_losses
from bert_reduce.functional import safe_divide
from bert_reduce.hf.lm_head import lm_head_inputs
from bert_reduce.normalization import sequence_normalizers
from bert_reduce.packing import batch_sequence_normalizers
from bert_reduce.reports import make_report
from bert_reduce.torch_loop import GlobalBatchLoss

try:
    import transformers
    from transformers import Trainer
except ModuleNotFoundError as error:  # pragma: no cover - the hf extra is missing
    raise ModuleNotFoundError(
        "bert_reduce.hf.ExactMLMTrainer needs Hugging Face transformers and accelerate: "
        "pip install 'bert_reduce[hf]'."
    ) from error

TESTED_TRANSFORMERS_VERSIONS = ("5.24.0",)
"""``transformers`` versions the test suite runs :class:`ExactMLMTrainer` with."""


LOSS_ONLY_KEYS = ("labels", "loss_mask", "sequence_weight", "sequence_start", "num_scored")
"""Batch keys the loss reads and the model is not given. ``labels`` is kept from the model
so that it computes no loss of its own (and ``[b, s, v]`` logits are not scored twice).
Packing keys (``position_ids``, ``cu_seq_lens_q``, ...) go to both."""


def sample_loss_terms(
    batch: Mapping[str, Any], weights: Tensor, per_token_loss: Tensor, options: LossOptions
) -> Tensor:
    """``[n, 2]`` fp64 ``(numerator, denominator)`` of each of a batch's ``n`` samples.

    Their sum is the batch's :func:`bert_reduce.engine.mode_terms`. A sample is a row, or a
    packed sequence (in order): what ``gather_for_metrics`` drops the padding duplicates of.
    Reads the number of samples on the host (an evaluation-time sync).

    Args:
        batch: The batch; its sequences as
            :func:`bert_reduce.packing.batch_sequence_normalizers` finds them.
        weights: ``[b, s]`` :func:`bert_reduce.engine.scored_weights`.
        per_token_loss: ``[b, s]`` losses.
        options: The loss options (their mode, constant and weight resolution).

    Returns:
        ``[n, 2]`` fp64, detached.
    """
    # Rows without packing keys are sequences of their own: their markers, then one loop.
    sequences = batch_sequence_normalizers(batch, weights) or dict(
        zip(("sequence_weight", "sequence_start"), sequence_normalizers(weights), strict=True)
    )
    start = sequences["sequence_start"] != 0
    # Sequence id of each token in row-major order (a sequence runs to the next start).
    sequence_id = start.reshape(-1).cumsum(0).view(start.shape) - 1
    pairs = [torch.zeros(0, 2, dtype=torch.float64, device=weights.device)]
    for index in range(int(start.sum())):
        inside = sequence_id == index
        sample = {**sequences, "sequence_start": start & inside}
        alone = torch.where(inside, weights, torch.zeros_like(weights))
        numerator, denominator = mode_terms(sample, alone, per_token_loss.detach(), options)
        pairs.append(make_report(numerator, denominator).view(1, 2))
    return torch.cat(pairs)


class ExactMLMTrainer(Trainer):
    """A ``transformers.Trainer`` whose masked-LM loss is exact over each global batch.

    A drop-in replacement: the same arguments, plus the loss options below. For any masked LM
    returning ``[b, s, v]`` ``logits``, and batches with ``labels`` (``[b, s]``, ``-100`` where
    unscored) and optionally ``loss_mask`` (``[b, s]`` bool, integer or float weights); the
    model is not given :data:`LOSS_ONLY_KEYS`. Use, and the hooks: ``docs/hf_trainer.md``.

    Args:
        *args: ``transformers.Trainer``'s positional arguments.
        fused_head: Train ``EsmForMaskedLM`` or ``BertForMaskedLM`` through the masked-only
            fused head (one host read per step; docs/hf_trainer.md, "Options").
        **kwargs: ``transformers.Trainer``'s keyword arguments, and the loss options
            (:class:`bert_reduce.LossOptions`' fields).

    Raises:
        RuntimeError: With a ``transformers`` lacking the Trainer hooks it overrides (tested
            with :data:`TESTED_TRANSFORMERS_VERSIONS`).
        ValueError: On a bad loss option, a ``compute_loss_func``, label smoothing, or several
            GPUs in one process (``DataParallel``).
        TypeError: With ``fused_head`` for a model other than ``EsmForMaskedLM`` or
            ``BertForMaskedLM``.
        NotImplementedError: Under tensor, context or sequence parallelism.
    """

    loss_is_scaled_for_ga = True
    """Trainer hook: each micro-batch's loss is already its share of the global batch."""

    def __init__(
        self,
        *args: Any,
        fused_head: bool = False,
        **kwargs: Any,
    ) -> None:
        # The two Trainer hooks this class overrides (docs/hf_trainer.md).
        parameters = list(inspect.signature(Trainer.get_batch_samples).parameters)[1:4]
        expected = ["epoch_iterator", "num_batches", "device"]
        if not hasattr(Trainer, "loss_is_scaled_for_ga") or parameters != expected:
            raise RuntimeError(
                f"ExactMLMTrainer needs transformers.Trainer.loss_is_scaled_for_ga and "
                f"get_batch_samples(epoch_iterator, num_batches, device), which transformers "
                f"{transformers.__version__} does not have; it is tested with transformers "
                f"{', '.join(TESTED_TRANSFORMERS_VERSIONS)} (pip install -c "
                "requirements/constraints-cpu.txt 'bert_reduce[hf]')."
            )
        names = [field.name for field in dataclasses.fields(LossOptions)]
        self.options = LossOptions(**{name: kwargs.pop(name) for name in names if name in kwargs})
        self.fused_head = fused_head
        # Evaluation sums: [loss_sum, denominator, labelled batches] of this process, and the
        # same of the eval set's last batch, gathered without the sampler's duplicates.
        self._eval_local: Tensor | None = None
        self._eval_last: Tensor | None = None
        self._logits_wanted = True
        super().__init__(*args, **kwargs)
        if self.compute_loss_func is not None:
            raise ValueError(
                "ExactMLMTrainer computes the loss itself; drop compute_loss_func (choose the "
                "normalization with normalization=... instead)."
            )
        if self.args.label_smoothing_factor != 0:
            raise ValueError(
                "ExactMLMTrainer does not implement label smoothing; set "
                f"label_smoothing_factor=0 (got {self.args.label_smoothing_factor})."
            )
        if self.args.n_gpu > 1:
            raise ValueError(
                f"ExactMLMTrainer does not support torch.nn.DataParallel ({self.args.n_gpu} GPUs "
                "in one process); launch one process per GPU (torchrun, accelerate launch)."
            )
        sizes = {"tensor": self.get_tp_size(), "context": self.get_cp_size()}
        sizes["sequence"] = self.get_sp_size()
        if any(size != 1 for size in sizes.values()):
            raise NotImplementedError(
                f"ExactMLMTrainer supports data parallelism only; got parallel sizes {sizes}."
            )
        if fused_head and self.model is not None:
            from transformers import BertForMaskedLM, EsmForMaskedLM

            if not isinstance(self.model, EsmForMaskedLM | BertForMaskedLM):
                raise TypeError(
                    "fused_head=True supports EsmForMaskedLM and BertForMaskedLM, got "
                    f"{type(self.model).__name__}; use fused_head=False (the model's logits)."
                )
        # The model gets no labels and computes no loss: Trainer must not count tokens for it
        # (nor all-gather the count under average_tokens_across_devices).
        self.model_accepts_loss_kwargs = False
        # The data-parallel processes whose batches make up the global batch.
        self._loss_group = dist.group.WORLD if self.accelerator.num_processes > 1 else None
        # The step's global denominator and each micro-batch's share, as a PyTorch loop has
        # them; DDP's mean over the processes is what the share's world size undoes.
        self._global_loss = GlobalBatchLoss(self._loss_group, **dataclasses.asdict(self.options))

    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, Tensor]:
        """The optimizer step's micro-batches and the global denominator: one all-reduce.

        Returns:
            ``(batches, global_denominator)``: :meth:`bert_reduce.GlobalBatchLoss.begin`'s
            denominator, which Trainer passes to :meth:`compute_loss` as
            ``num_items_in_batch``. With ``fused_head``, each batch also gets its
            ``num_scored`` (read on the host here, once per step), unless it has one.
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.fused_head and batches:
            # So that the fused head computes exactly each micro-batch's scored rows, no sync.
            ignore_index = self.options.ignore_index
            counts = [torch.count_nonzero(scored_weights(b, ignore_index)) for b in batches]
            for batch, count in zip(batches, torch.stack(counts).tolist(), strict=True):
                batch.setdefault("num_scored", count)
        denominator = self._global_loss.begin(batches)
        return batches, denominator.to(device)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor | tuple[Tensor, Any]:
        """This micro-batch's share of the global loss (training) or its own mean.

        Args:
            model: The (possibly DDP-wrapped) model.
            inputs: The batch, with ``labels`` ``[b, s]``.
            return_outputs: Also return the model's outputs (evaluation).
            num_items_in_batch: The step's global denominator from :meth:`get_batch_samples`;
                ``None`` gives the batch's own exact mean.

        Returns:
            The 0-dim share :meth:`bert_reduce.GlobalBatchLoss.__call__` returns, or the
            batch's mean (see ``num_items_in_batch``); with ``return_outputs``, ``(loss, outputs)``.
        """
        fused = self.fused_head and (model.training or not self._logits_wanted)
        model_inputs = {key: value for key, value in inputs.items() if key not in LOSS_ONLY_KEYS}
        outputs = None
        if fused:
            forward_out = lm_head_inputs(model, **model_inputs)
        else:
            outputs = model(**model_inputs)
            forward_out = outputs.logits
        if model.training and num_items_in_batch is not None:
            # This micro-batch's share of the step that get_batch_samples began.
            loss = self._global_loss(forward_out, inputs)
        elif model.training or self._eval_local is None:
            loss = safe_divide(*loss_terms(inputs, forward_out, self.options, layout="bs"))
        else:
            loss = self._eval_loss(inputs, forward_out)
        if return_outputs:
            return loss, ({} if outputs is None else outputs)
        return loss

    def _eval_loss(self, inputs: dict[str, Any], forward_out: Any) -> Tensor:
        """Add an eval batch's ``(loss_sum, denominator)``, padding duplicates dropped; its mean."""
        # Each token's loss is kept, for the per-sample sums of the last batch.
        weights = scored_weights(inputs, self.options.ignore_index)
        losses = token_losses(inputs, forward_out, self.options, layout="bs", weights=weights)
        numerator, denominator = mode_terms(inputs, weights, losses, self.options)
        one = torch.ones(1, dtype=torch.float64, device=numerator.device)
        gradient_state = self.accelerator.gradient_state
        if self.accelerator.num_processes > 1 and gradient_state.end_of_dataloader:
            # Only the last batch holds the distributed sampler's padding: its per-sample
            # terms are gathered, and gather_for_metrics keeps the real samples only.
            if gradient_state.remainder == -1:
                raise ValueError(
                    "ExactMLMTrainer cannot tell the padding duplicates of this eval set apart "
                    "across processes (it has no length): give evaluate() a dataset with "
                    "__len__, or evaluate on one process."
                )
            terms = sample_loss_terms(inputs, weights, losses, self.options)
            gathered = self.accelerator.gather_for_metrics(terms)
            self._eval_last += torch.cat([gathered.sum(dim=0), one])
        else:
            self._eval_local += torch.cat([make_report(numerator, denominator), one])
        return safe_divide(numerator, denominator)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Trainer's ``prediction_step``; the fused head serves when no logits are wanted."""
        self._logits_wanted = not prediction_loss_only
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        finally:
            self._logits_wanted = True

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``evaluation_loop``, with the exact ``<prefix>_loss`` and ``_perplexity``.

        How: docs/hf_trainer.md, "Evaluation". Without labels the metrics are Trainer's.
        """
        signature = inspect.signature(Trainer.evaluation_loop).bind(self, *args, **kwargs)
        signature.apply_defaults()
        prefix = signature.arguments["metric_key_prefix"]
        self._eval_local = torch.zeros(3, dtype=torch.float64, device=self.args.device)
        self._eval_last = torch.zeros_like(self._eval_local)
        try:
            output = super().evaluation_loop(*args, **kwargs)
            totals = distributed.all_reduce_sum_(self._eval_local, self._loss_group)
            totals = totals + self._eval_last
        finally:
            self._eval_local = self._eval_last = None
        loss_sum, denominator, labelled_batches = totals.tolist()
        if labelled_batches > 0 and output.metrics is not None:
            loss = loss_sum / denominator if denominator != 0 else 0.0
            output.metrics[f"{prefix}_loss"] = loss
            output.metrics[f"{prefix}_perplexity"] = math.exp(loss)
        return output
