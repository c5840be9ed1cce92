"""Token perplexity from ``(loss_sum, num_tokens)``: a pure-torch core and a torchmetrics shell.

Perplexity is ``exp(mean NLL over every scored token)``. Like the loss, it is exact only when
sums and counts are added up first and divided once: averaging per-batch perplexities (or
per-batch mean losses) weights small batches as much as large ones. The functions here work
on the same ``(loss_sum, num_tokens)`` the loss reduction produces, so the metric needs
neither the logits nor a second forward pass, and it works with vocab-sharded logits (tensor
parallelism) because the per-token loss comes from Megatron's vocab-parallel cross-entropy.

An empty set of tokens has a mean loss of 0 by the library's convention (see
:func:`bert_reduce.functional.safe_divide`), hence a perplexity of ``exp(0) = 1.0``: never NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from bert_reduce import distributed
from bert_reduce.functional import (
    check_same_shape,
    masked_token_loss,
    safe_divide,
    unreduced_token_loss_fn,
)

__all__ = [
    "REPORT_KEY",
    "TokenPerplexity",
    "perplexity_from_sums",
    "report_loss_sums",
    "token_loss_sums",
]

REPORT_KEY = "loss_sum_and_microbatch_size"
"""Key of the ``[2]`` fp64 ``(loss_sum, num_tokens)`` tensor in a loss-reduction report."""


def perplexity_from_sums(loss_sum: Tensor, num_tokens: Tensor) -> Tensor:
    """``exp(loss_sum / num_tokens)`` in fp64, and 1.0 where ``num_tokens == 0``; no host sync.

    Args:
        loss_sum: Sum of per-token negative log-likelihoods (natural log), any shape.
        num_tokens: Number of tokens in each sum, same shape as ``loss_sum``.

    Returns:
        fp64 perplexity of the same shape.

    Raises:
        ValueError: When the two shapes differ.
    """
    check_same_shape(loss_sum, num_tokens, ("loss_sum", "num_tokens"))
    return torch.exp(safe_divide(loss_sum.to(torch.float64), num_tokens))


def token_loss_sums(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Detached ``(loss_sum, num_tokens)`` of one micro-batch on this rank.

    The per-token loss is :func:`bert_reduce.functional.unreduced_token_loss_fn`, so logits
    sharded over the vocabulary (tensor parallelism, Megatron's parallel state initialized)
    give the loss of the full vocabulary, identical on every tensor-parallel rank. No graph is
    built, and ``logits`` are neither kept nor modified.

    Args:
        logits: ``[s, b, v]`` logits (``v`` this rank's shard under tensor parallelism).
        labels: ``[b, s]`` integer token ids; unscored positions may hold anything (e.g. -100).
        loss_mask: ``[b, s]``; non-zero where the token is scored.

    Returns:
        A 0-dim fp64 loss sum (computed in fp32, or fp64 for fp64 logits without Megatron) and
        a 0-dim int64 token count.

    Raises:
        ValueError: On mismatched shapes (the message names them).
    """
    check_same_shape(labels, loss_mask, ("labels", "loss_mask"), "[b, s]")
    with torch.no_grad():
        per_token_loss = unreduced_token_loss_fn(logits, labels)
        loss_sum, num_tokens = masked_token_loss(per_token_loss, loss_mask)
    return loss_sum.to(torch.float64), num_tokens


def report_loss_sums(
    reports: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> tuple[Tensor, Tensor]:
    """``(loss_sum, num_tokens)`` added up over loss-reduction reports.

    Args:
        reports: One report (a mapping such as
            :class:`bert_reduce.reduction.PerTokenLossDict`) or a sequence of them, e.g. one per
            micro-batch. Each holds ``loss_sum_and_microbatch_size``: a ``[2]`` tensor
            ``(loss_sum, num_tokens)``, or ``[..., 2]`` to be summed over the leading dims.

    Returns:
        A 0-dim fp64 loss sum and a 0-dim int64 token count (reports carry counts as exact
        integers in fp64; they are rounded, not truncated). An empty sequence gives zeros on
        the current device.

    Raises:
        KeyError: When a report lacks ``loss_sum_and_microbatch_size`` (the message lists its
            keys).
        TypeError: When ``reports`` is not a mapping or a sequence of mappings, or the value is
            not a tensor.
        ValueError: When the value's last dim is not 2.
    """
    if isinstance(reports, Mapping):
        reports = [reports]
    if not isinstance(reports, Sequence) or not all(isinstance(r, Mapping) for r in reports):
        raise TypeError(
            f"Expected a loss report (a mapping with key {REPORT_KEY!r}) or a sequence of them, "
            f"got {type(reports).__name__}."
        )
    if len(reports) == 0:
        device = distributed.default_device()
        return (
            torch.zeros((), dtype=torch.float64, device=device),
            torch.zeros((), dtype=torch.int64, device=device),
        )
    pairs = []
    for index, report in enumerate(reports):
        if REPORT_KEY not in report:
            raise KeyError(f"report {index} has no {REPORT_KEY!r} key; it has {sorted(report)}.")
        value = report[REPORT_KEY]
        if not isinstance(value, Tensor):
            raise TypeError(
                f"report {index}[{REPORT_KEY!r}] must be a torch.Tensor, got "
                f"{type(value).__name__}."
            )
        if value.dim() == 0 or value.size(-1) != 2:
            raise ValueError(
                f"report {index}[{REPORT_KEY!r}] must have shape [2] or [..., 2] "
                f"(loss_sum, num_tokens), got {tuple(value.shape)}."
            )
        pairs.append(value.detach().to(torch.float64).reshape(-1, 2).sum(dim=0))
    loss_sum, num_tokens = torch.stack(pairs).sum(dim=0).unbind()
    return loss_sum, num_tokens.round().to(torch.int64)


class TokenPerplexity(Metric):
    """Perplexity over every scored token seen, from summed ``(loss_sum, num_tokens)``.

    States are a fp64 loss sum and an int64 token count, both summed across processes
    (``dist_reduce_fx="sum"``), so the result is exactly ``exp(total NLL / total tokens)``
    however the tokens were split into batches and ranks. ``update`` neither reads device
    values on the host nor runs a collective; the one sync is torchmetrics' own, in
    ``compute``.

    Which processes are summed: ``process_group`` if given, else, resolved at sync time,
    :func:`bert_reduce.distributed.loss_reduction_group`: Megatron's data x context parallel
    group when its parallel state is initialized (tensor-parallel ranks hold the same sums and
    must not be added up), else the default group.

    With no token counted, ``compute`` returns 1.0 (``exp`` of the empty mean, 0), not NaN.

    Example:
        >>> metric = TokenPerplexity()
        >>> metric.update(torch.tensor(6.0), torch.tensor(3))
        >>> metric.compute()
        tensor(7.3891, dtype=torch.float64)

    Args:
        process_group: Group whose states are summed in ``compute``; see above.
        **kwargs: Other :class:`torchmetrics.Metric` options (``sync_on_compute``, ...).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    loss_sum: Tensor
    num_tokens: Tensor

    def __init__(self, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_tokens", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group summed over in ``compute`` (see the class docstring)."""
        if self._process_group is not None:
            return self._process_group
        return distributed.loss_reduction_group()

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self._process_group = group

    def update(self, loss_sum: Tensor, num_tokens: Tensor) -> None:
        """Add token-loss sums and their token counts.

        Args:
            loss_sum: Sum of per-token NLLs (natural log); any shape, all elements are added.
            num_tokens: Token counts, same shape; integer, or float holding integers (as loss
                reports do), which are rounded.

        Raises:
            ValueError: When the two shapes differ.
        """
        check_same_shape(loss_sum, num_tokens, ("loss_sum", "num_tokens"))
        if num_tokens.dtype.is_floating_point:
            num_tokens = num_tokens.detach().round()
        self.loss_sum += loss_sum.detach().to(self.loss_sum).sum()
        self.num_tokens += num_tokens.detach().to(self.num_tokens).sum()

    def update_from_logits(self, logits: Tensor, labels: Tensor, loss_mask: Tensor) -> None:
        """Add one micro-batch from its logits, without keeping them; works under TP.

        Args:
            logits: ``[s, b, v]`` logits (``v`` this rank's vocab shard under TP).
            labels: ``[b, s]`` integer token ids.
            loss_mask: ``[b, s]``; non-zero where the token is scored.

        Raises:
            ValueError: On mismatched shapes (see :func:`token_loss_sums`).
        """
        self.update(*token_loss_sums(logits, labels, loss_mask))

    def update_from_reports(self, reports: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Add loss-reduction reports; see :func:`report_loss_sums`.

        Raises:
            KeyError: When a report lacks ``loss_sum_and_microbatch_size``.
            TypeError: When ``reports`` is neither a report nor a sequence of reports.
            ValueError: When a report's value is not ``[2]`` or ``[..., 2]``.
        """
        self.update(*report_loss_sums(reports))

    def compute(self) -> Tensor:
        """``exp(loss_sum / num_tokens)`` over everything seen (synced); 1.0 when empty.

        Returns:
            0-dim fp64 perplexity.
        """
        return perplexity_from_sums(self.loss_sum, self.num_tokens)
