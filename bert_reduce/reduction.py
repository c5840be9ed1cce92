"""NeMo 2 / Megatron-Core loss reduction for BERT masked-language modelling."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from bert_reduce import distributed, forward_output
from bert_reduce.engine import LossOptions, loss_terms
from bert_reduce.forward_output import Layout, check_layout
from bert_reduce.reports import (
    DataParallelGroupLossAndIO,
    LossReport,
    PerTokenLossDict,
    make_report,
    reduce_reports,
)

__all__ = ["BERTMLMLossWithReduction", "MegatronLossReduction"]

DataT = TypeVar("DataT")
ReductionT = TypeVar("ReductionT")

try:
    from nemo.lightning.megatron_parallel import MegatronLossReduction
except ImportError:

    class MegatronLossReduction(nn.Module, Generic[DataT, ReductionT]):  # type: ignore[no-redef]
        """NeMo 2's loss-reduction contract, for when NeMo is not installed.

        Calling the module on the model's output reaches ``forward(batch, forward_out)``, with
        the batch of :meth:`setup`. With NeMo installed, this name is NeMo's own class, so
        NeMo's ``isinstance`` checks pass.
        """

        def __init__(self) -> None:
            super().__init__()
            self.batch: DataT | None = None
            self.register_forward_pre_hook(self._pre_forward_hook)

        def setup(self, batch: DataT) -> None:
            """Remember the micro-batch the next call's ``forward`` receives."""
            self.batch = batch

        def _pre_forward_hook(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (self.batch, *args)

        def forward(self, batch: DataT, forward_out: Any) -> tuple[Any, ...]:
            """Loss of one micro-batch and its report."""
            raise NotImplementedError

        def reduce(self, losses_reduced_per_micro_batch: Sequence[ReductionT]) -> Tensor:
            """One scalar from the reports of every micro-batch of a step."""
            raise NotImplementedError


def _detached(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in mapping.items()}


class BERTMLMLossWithReduction(MegatronLossReduction):
    """Masked-language-model loss over the masked tokens, exact under any split of the batch.

    ``forward`` returns a micro-batch's ``(loss_sum, num_tokens, report)``, ``reduce`` the exact
    global mean; the Megatron-Core settings, collectives and host syncs: ``docs/megatron.md``.
    No state is kept between calls.

    Args:
        validation_step: Whether this instance serves validation (selects which
            ``send_*_output`` applies).
        val_drop_last: Accepted for BioNeMo compatibility; the reduction is exact either way.
        send_train_output: In training, also return the detached batch and model outputs.
        send_val_output: In validation, also return the detached batch and model outputs
            (off by default: why, ``docs/megatron.md``).
        forward_out_key: ``key`` of :func:`bert_reduce.engine.loss_terms`.
        layout: As in :func:`bert_reduce.engine.loss_terms`: ``"sb"`` (default) or ``"bs"``.
        check_labels: As in :func:`bert_reduce.engine.loss_terms`; for debugging (without it,
            a bad label or weight makes the loss NaN).
        **options: :class:`bert_reduce.LossOptions`' fields. Megatron sums ``forward``'s
            denominators in int32: a float mask in per-token mode needs ``weight_resolution``.

    Raises:
        ValueError: On a bad option (:class:`bert_reduce.LossOptions`), ``forward_out_key``
            or ``layout``.

    Example:
        >>> loss_fn = BERTMLMLossWithReduction()
        >>> loss_fn.setup({"labels": torch.tensor([[1, 2]]), "loss_mask": torch.tensor([[1, 0]])})
        >>> loss_sum, num_tokens, report = loss_fn({"token_logits": torch.zeros(2, 1, 4)})
        >>> loss_sum, num_tokens
        (tensor(1.3863), tensor(1))
    """

    def __init__(
        self,
        validation_step: bool = False,
        val_drop_last: bool = True,
        send_train_output: bool = False,
        send_val_output: bool = False,
        *,
        forward_out_key: str | None = None,
        layout: Layout = "sb",
        check_labels: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        self.validation_step = validation_step
        self.val_drop_last = val_drop_last
        self.send_train_output = send_train_output
        self.send_val_output = send_val_output
        if forward_out_key is not None:
            forward_output.forward_out_key({}, forward_out_key)  # raises on an unknown key
        self.forward_out_key = forward_out_key
        self.layout = check_layout(layout)
        self.check_labels = check_labels
        self.options = LossOptions(**options)

    def forward(
        self, batch: Mapping[str, Any], forward_out: Tensor | Mapping[str, Any]
    ) -> tuple[Tensor, Tensor, PerTokenLossDict | DataParallelGroupLossAndIO]:
        """Loss sum and masked-token count of one micro-batch on this rank.

        Args:
            batch: The micro-batch (under context parallelism, this rank's shard), as in
                :func:`bert_reduce.engine.loss_terms`.
            forward_out: As in :func:`bert_reduce.engine.loss_terms`.

        Returns:
            ``(loss_sum, num_tokens, report)``: :func:`bert_reduce.engine.loss_terms`'
            numerator (carrying the gradient) and denominator, and the detached report
            ``[numerator, denominator]`` for :meth:`reduce`.

        Raises:
            KeyError, TypeError, ValueError: As :func:`bert_reduce.engine.loss_terms`.
        """
        loss_sum, num_tokens = loss_terms(
            batch,
            forward_out,
            self.options,
            layout=self.layout,
            key=self.forward_out_key,
            context_parallel_size=distributed.context_parallel_world_size(),
            check_labels=self.check_labels,
        )
        report = make_report(loss_sum, num_tokens)
        if not (self.send_val_output if self.validation_step else self.send_train_output):
            return loss_sum, num_tokens, {"loss_sum_and_microbatch_size": report}
        with_io = DataParallelGroupLossAndIO(
            loss_sum_and_microbatch_size=report,
            batch=_detached(batch),
            forward_out=_detached(forward_output.as_forward_out(forward_out, self.layout)),
        )
        return loss_sum, num_tokens, with_io

    def reduce(self, losses_reduced_per_micro_batch: Sequence[LossReport]) -> Tensor:
        """Exact mean loss over every masked token of the global batch, as a float32 scalar.

        :func:`bert_reduce.reports.reduce_reports` over the default loss-reduction group, in
        fp64; only the quotient is cast (why: ``docs/nemo.md``).

        Returns:
            A 0-dim float32 tensor (0.0 when the global batch has no scored token).
        """
        return reduce_reports(losses_reduced_per_micro_batch).to(torch.float32)
