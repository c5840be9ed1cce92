"""Token perplexity from ``(loss_sum, denominator)``: a pure-torch core and a torchmetrics shell.

Sums added up first, divided once: ``docs/perplexity.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from bert_reduce import distributed
from bert_reduce.engine import LossOptions, loss_terms
from bert_reduce.forward_output import Layout
from bert_reduce.functional import check_same_shape, safe_divide
from bert_reduce.reports import sum_reports


def perplexity_from_sums(loss_sum: Tensor, denominator: Tensor) -> Tensor:
    """``exp(loss_sum / denominator)`` in fp64, and 1.0 where ``denominator == 0``; no host sync.

    Args:
        loss_sum: Sum of (weighted) per-token negative log-likelihoods (natural log), any shape.
        denominator: :func:`bert_reduce.functional.token_denominator` of each sum (the token
            count, or the sum of the weights), same shape as ``loss_sum``.

    Returns:
        fp64 perplexity of the same shape.

    Raises:
        ValueError: When the two shapes differ.
    """
    check_same_shape(loss_sum, denominator, ("loss_sum", "denominator"))
    return torch.exp(safe_divide(loss_sum.to(torch.float64), denominator))


class TokenPerplexity(Metric):
    """Perplexity over every scored token seen, from summed ``(loss_sum, denominator)``.

    Two fp64 states summed across processes, so exact however the tokens were split; its host
    syncs and collectives: ``docs/perplexity.md``.

    Example:
        >>> metric = TokenPerplexity()
        >>> metric.update(torch.tensor(6.0), torch.tensor(3))
        >>> metric.compute()
        tensor(7.3891, dtype=torch.float64)

    Args:
        process_group: Group whose states are summed in ``compute``; ``None``: resolved at
            sync time, :func:`bert_reduce.distributed.loss_reduction_group` (Megatron's data x
            context group, never its tensor-parallel ranks, which hold the same sums).
        **kwargs: Other :class:`torchmetrics.Metric` options (``sync_on_compute``, ...).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    loss_sum: Tensor
    denominator: Tensor

    def __init__(self, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("denominator", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group summed over in ``compute`` (see the class docstring)."""
        if self._process_group is not None:
            return self._process_group
        return distributed.loss_reduction_group()

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self._process_group = group

    def update(self, loss_sum: Tensor, denominator: Tensor) -> None:
        """Add token-loss sums and their denominators.

        Args:
            loss_sum: As in :func:`perplexity_from_sums`; all elements are added.
            denominator: As in :func:`perplexity_from_sums`, integer or float, taken as it is.

        Raises:
            ValueError: When the two shapes differ.
        """
        check_same_shape(loss_sum, denominator, ("loss_sum", "denominator"))
        self.loss_sum += loss_sum.detach().to(self.loss_sum).sum()
        self.denominator += denominator.detach().to(self.denominator).sum()

    def update_from_logits(
        self,
        logits: Tensor,
        labels: Tensor,
        loss_mask: Tensor | None = None,
        *,
        layout: Layout = "sb",
        **options: Any,
    ) -> None:
        """Add one micro-batch from its logits, without keeping them; works under TP.

        The sums are the loss's (:func:`bert_reduce.engine.loss_terms`), without a graph; its
        memory and tensor parallelism: ``docs/perplexity.md``. No host sync.

        Args:
            logits: ``[s, b, v]`` logits (``layout="sb"``, default) or ``[b, s, v]``
                (``"bs"``); ``v`` this rank's vocab shard under TP.
            labels: ``[b, s]`` integer token ids; ``ignore_index`` (``-100``) where unscored.
            loss_mask: ``[b, s]`` or ``None``, as in :func:`bert_reduce.engine.scored_weights`.
            layout: The layout of ``logits``.
            **options: :class:`bert_reduce.LossOptions`' fields; per token by default.

        Raises:
            ValueError: On mismatched shapes (the message names them) or a bad option.

        Example:
            >>> metric = TokenPerplexity()
            >>> logits, labels = torch.zeros(1, 2, 4), torch.tensor([[3, -100]])  # [b, s, v]
            >>> metric.update_from_logits(logits, labels, layout="bs")
            >>> metric.compute()
            tensor(4.0000, dtype=torch.float64)
        """
        batch = {"labels": labels}
        if loss_mask is not None:
            batch["loss_mask"] = loss_mask
        with torch.no_grad():
            loss_sum, denominator = loss_terms(batch, logits, LossOptions(**options), layout=layout)
        self.update(loss_sum.to(torch.float64), denominator.to(torch.float64))

    def update_from_reports(self, reports: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Add loss-reduction reports; see :func:`bert_reduce.reports.sum_reports`.

        Raises:
            KeyError, TypeError, ValueError: As :func:`bert_reduce.reports.sum_reports`.
        """
        self.update(*sum_reports(reports))

    def compute(self) -> Tensor:
        """``exp(loss_sum / denominator)`` over everything seen (synced); 1.0 when empty.

        Returns:
            0-dim fp64 perplexity.
        """
        return perplexity_from_sums(self.loss_sum, self.denominator)
