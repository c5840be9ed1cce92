"""The exact masked-LM loss for a hand-written PyTorch training step (DDP, FSDP2, CP, packing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from bert_reduce import distributed
from bert_reduce.engine import LossOptions, loss_terms, mode_terms, scored_weights
from bert_reduce.forward_output import Layout, check_layout
from bert_reduce.functional import safe_divide
from bert_reduce.reports import make_report

__all__ = ["GlobalBatchLoss"]

GradientSync = Literal["mean", "sum"]

_DEFAULT_GROUP: Any = object()


class GlobalBatchLoss:
    """Exact masked-LM loss of a global batch, fed micro-batch by micro-batch in your own loop.

    A micro-batch holds ``labels`` and optionally ``loss_mask``
    (:func:`bert_reduce.engine.scored_weights`); the step, with DDP's and FSDP2's gradient
    sync: ``docs/pytorch_loop.md`` (the algebra: ``docs/guarantees.md``).

    Args:
        group: The ranks whose micro-batches make up the global batch; ``None`` for none. By
            default :func:`bert_reduce.distributed.loss_reduction_group`, at every :meth:`begin`.
        layout: As in :func:`bert_reduce.engine.loss_terms`: ``"bs"`` (default) or ``"sb"``.
        gradient_sync: How the data-parallel wrapper combines the ranks' gradients:
            ``"mean"`` (DDP's and FSDP2's default) or ``"sum"`` (``docs/pytorch_loop.md``).
        gradient_average_size: With ``gradient_sync="mean"``, how many ranks the gradients
            are averaged over; the size of ``group`` by default.
        context_parallel_size: As in :func:`bert_reduce.engine.loss_terms` (1: no context
            parallelism; above, ``docs/normalization.md``).
        equal_micro_batch_counts: Require every rank of ``group`` to run as many micro-batches
            as the others (FSDP2; ``docs/pytorch_loop.md``): :meth:`begin` then reads the
            counts on the host (one sync per step). Off by default: DDP runs any number.
        **options: :class:`bert_reduce.LossOptions`' fields.

    Raises:
        ValueError: On a bad option (:class:`bert_reduce.LossOptions`), layout or gradient
            sync.

    Example:
        >>> loss_fn = GlobalBatchLoss(group=None)
        >>> mb = {"labels": torch.tensor([[1, -100, 2]])}
        >>> loss_fn.begin([mb])
        tensor(2., dtype=torch.float64)
        >>> loss_fn(torch.zeros(1, 3, 4, requires_grad=True), mb).backward()  # [b, s, v]
        >>> loss_fn.end()
        tensor(1.3863, dtype=torch.float64)
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = _DEFAULT_GROUP,
        *,
        layout: Layout = "bs",
        gradient_sync: GradientSync = "mean",
        gradient_average_size: int | None = None,
        context_parallel_size: int = 1,
        equal_micro_batch_counts: bool = False,
        **options: Any,
    ) -> None:
        self._group_argument = group
        self.group: dist.ProcessGroup | None = None
        self.options = LossOptions(**options)
        self.layout = check_layout(layout)
        if gradient_sync not in ("mean", "sum"):
            raise ValueError(f"gradient_sync must be 'mean' or 'sum', got {gradient_sync!r}.")
        if context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}.")
        self.gradient_sync = gradient_sync
        self.gradient_average_size = gradient_average_size
        self.context_parallel_size = context_parallel_size
        self.equal_micro_batch_counts = equal_micro_batch_counts
        self._scale: Tensor | None = None
        self._expected = 0
        self._calls = 0
        self._totals: Tensor | None = None

    def _group_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def begin(self, micro_batches: Sequence[Mapping[str, Any]]) -> Tensor:
        """Start a step: the global denominator, from one all-reduce over ``group``.

        Args:
            micro_batches: This rank's micro-batches of the step (possibly none), in any
                order; each is then passed once to :meth:`__call__`.

        Returns:
            The 0-dim fp64 global denominator (the number of scored tokens of the global
            batch in per-token mode).

        Raises:
            TypeError: If ``micro_batches`` is not a sequence (a generator would be used up).
            KeyError, ValueError: On a malformed micro-batch (see
                :func:`bert_reduce.engine.scored_weights`).
            ValueError: With ``equal_micro_batch_counts``, on every rank, when the ranks hold
                different numbers of micro-batches (the message lists them by rank).
        """
        if isinstance(micro_batches, Mapping) or not isinstance(micro_batches, Sequence):
            raise TypeError(
                "begin() takes this rank's micro-batches of the step as a list (a sequence of "
                f"mappings), got {type(micro_batches).__name__}."
            )
        # The default group is looked up here, not at construction: the loss may be built
        # before the process group is.
        self.group = (
            distributed.loss_reduction_group()
            if self._group_argument is _DEFAULT_GROUP
            else self._group_argument
        )
        device = distributed.default_device()
        denominator = torch.zeros((), dtype=torch.float64, device=device)
        for micro_batch in micro_batches:
            weights = scored_weights(micro_batch, self.options.ignore_index)
            _, count = mode_terms(
                micro_batch, weights, None, self.options,
                context_parallel_size=self.context_parallel_size,
            )  # fmt: skip
            denominator = denominator.to(count.device) + count.to(torch.float64)
        checked = self.equal_micro_batch_counts and self._group_size() > 1
        # [denominator, micro-batches of rank 0, ..., of rank n-1]: each rank fills its own
        # slot, so the one SUM all-reduce also gives every rank every rank's count.
        totals = denominator.view(1)
        if checked:
            counts = denominator.new_zeros(self._group_size())
            counts[dist.get_rank(self.group)] = len(micro_batches)
            totals = torch.cat([totals, counts])
        distributed.all_reduce_sum_(totals, self.group)
        denominator = totals[0]
        if checked:
            self._check_micro_batch_counts(totals[1:], len(micro_batches))
        world = self.gradient_average_size or self._group_size()
        ranks = world if self.gradient_sync == "mean" else 1
        # share = loss_sum * ranks / global_denominator: the ranks' gradient mean then sums.
        self._scale = safe_divide(torch.full_like(denominator, ranks), denominator)
        self._expected = len(micro_batches)
        self._calls = 0
        # (loss_sum, denominator) of this rank's micro-batches, summed as they come.
        self._totals = torch.zeros(2, dtype=torch.float64, device=denominator.device)
        return denominator

    def _check_micro_batch_counts(self, counts: Tensor, mine: int) -> None:
        # The price of the check: the all-reduced counts are read on the host.
        by_rank = [int(count) for count in counts.tolist()]
        if len(set(by_rank)) > 1:
            rank = dist.get_rank(self.group)
            raise ValueError(
                f"GlobalBatchLoss.begin(): the ranks hold different numbers of micro-batches "
                f"({dict(enumerate(by_rank))} by rank; this rank, {rank}, holds {mine}). "
                "Under FSDP2 every forward all-gathers the parameters, so every rank must run "
                "the same number of micro-batches or the ranks wait on each other forever: "
                "give the short ranks micro-batches whose labels are all ignore_index (they "
                "add nothing to the loss)."
            )

    def __call__(
        self, output: Tensor | Mapping[str, Any], micro_batch: Mapping[str, Any]
    ) -> Tensor:
        """This micro-batch's share of the global loss, to back-propagate; no collective.

        Args:
            output: ``forward_out`` of :func:`bert_reduce.engine.loss_terms`, e.g. logits in
                ``layout`` or :func:`bert_reduce.hf.lm_head_inputs`' (the fused head).
            micro_batch: One of the micro-batches given to :meth:`begin`.

        Returns:
            The 0-dim ``loss_sum * world_size / global_denominator`` (fp32, fp64 for fp64
            logits or hidden states); these summed over micro-batches and averaged over ranks
            are the global loss.

        Raises:
            RuntimeError: Before :meth:`begin`, or when called more often than it had
                micro-batches.
            KeyError, TypeError, ValueError: As :func:`bert_reduce.engine.loss_terms`.
        """
        if self._scale is None or self._calls >= self._expected:
            raise RuntimeError(
                f"GlobalBatchLoss was called {self._calls + 1} times after begin() "
                f"received {self._expected} micro-batches; call begin(micro_batches) with every "
                "micro-batch of the step first."
            )
        numerator, denominator = loss_terms(
            micro_batch, output, self.options, layout=self.layout,
            context_parallel_size=self.context_parallel_size,
        )  # fmt: skip
        self._totals = self._totals + make_report(numerator, denominator).to(self._totals)
        self._calls += 1
        return numerator * self._scale.to(device=numerator.device, dtype=numerator.dtype)

    def end(self) -> Tensor:
        """Finish the step: the exact global loss, from one all-reduce over ``group``.

        Returns:
            The 0-dim fp64 global loss (detached); 0.0 when the global batch scores nothing.

        Raises:
            RuntimeError: If not every micro-batch given to :meth:`begin` was passed to
                :meth:`__call__`.
        """
        if self._scale is None or self._totals is None or self._calls != self._expected:
            raise RuntimeError(
                f"end() after {self._calls} of {self._expected} micro-batches: pass every "
                "micro-batch given to begin() through the loss first."
            )
        # A rank without micro-batches still joins the all-reduce, with (0, 0).
        totals = distributed.all_reduce_sum_(self._totals, self.group)
        self._scale, self._expected, self._calls, self._totals = None, 0, 0, None
        return safe_divide(*totals.unbind())
