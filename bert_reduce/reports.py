"""The report format: what one micro-batch hands to the reduction, defined once.

Every consumer adds reports up with :func:`sum_reports` and divides once
(``docs/guarantees.md``; fp64: counts exact to 2**53). NeMo's validation reports with
``val_drop_last=False``, already summed over data-parallel ranks, scale sum and denominator
alike and so leave every ratio unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import Tensor

from bert_reduce import distributed
from bert_reduce.functional import safe_divide

REPORT_KEY = "loss_sum_and_microbatch_size"
"""Key of the ``[2]`` fp64 ``(loss_sum, denominator)`` tensor of a report."""

NEMO_REPORT_KEY = "loss_sum_and_ub_size"
"""NeMo 2's and BioNeMo's name for the same pair, accepted wherever reports are read."""


class PerTokenLossDict(TypedDict):
    """What one micro-batch reports on one rank, before any reduction.

    Attributes:
        loss_sum_and_microbatch_size: ``[2]`` fp64 detached ``(loss_sum, denominator)``.
    """

    loss_sum_and_microbatch_size: Tensor


class DataParallelGroupLossAndIO(PerTokenLossDict):
    """A :class:`PerTokenLossDict` that also carries the micro-batch and the model's outputs.

    Produced only when ``send_train_output`` / ``send_val_output`` ask for it, for downstream
    metrics. Tensors are detached (not copied: the loss never writes to them).

    Attributes:
        batch: The micro-batch, e.g. ``labels`` and ``loss_mask`` of shape ``[b, s]``.
        forward_out: The model's outputs, e.g. ``token_logits`` of shape ``[s, b, v]``.
    """

    batch: dict[str, Any]
    forward_out: dict[str, Any]


class SameSizeLossDict(TypedDict):
    """A legacy report of BioNeMo's and NeMo's older reductions: a mean, without denominator.

    It is averaged as NeMo does (exact only for equal token counts); bert_reduce never
    produces one.

    Attributes:
        avg: ``[1]`` or 0-dim loss.
    """

    avg: Tensor


LossReport = PerTokenLossDict | DataParallelGroupLossAndIO | SameSizeLossDict


def make_report(loss_sum: Tensor, denominator: Tensor) -> Tensor:
    """The detached ``[2]`` fp64 ``(loss_sum, denominator)`` of a report; no host sync.

    Example:
        >>> make_report(torch.tensor(2.5, requires_grad=True), torch.tensor(3))
        tensor([2.5000, 3.0000], dtype=torch.float64)
    """
    return torch.stack([loss_sum.detach().to(torch.float64), denominator.to(torch.float64)])


def _report_pair(index: int, report: object) -> Tensor:
    """``(loss_sum, denominator)`` of one report, summed over any leading dims."""
    if not isinstance(report, Mapping):
        raise TypeError(
            f"report {index} must be a mapping with key {REPORT_KEY!r} (or {NEMO_REPORT_KEY!r}),"
            f" got {type(report).__name__}."
        )
    key = REPORT_KEY if REPORT_KEY in report else NEMO_REPORT_KEY
    if key not in report:
        hint = " (a legacy mean: it has no denominator to sum)" if "avg" in report else ""
        raise KeyError(
            f"report {index} has no {REPORT_KEY!r} or {NEMO_REPORT_KEY!r} key{hint}; it has "
            f"{sorted(report)}."
        )
    value = report[key]
    if not isinstance(value, Tensor):
        raise TypeError(
            f"report {index}[{key!r}] must be a torch.Tensor, got {type(value).__name__}."
        )
    if value.dim() == 0 or value.size(-1) != 2:
        raise ValueError(
            f"report {index}[{key!r}] must have shape [2] or [..., 2] (loss_sum, denominator), "
            f"got {tuple(value.shape)}."
        )
    return value.detach().to(torch.float64).reshape(-1, 2).sum(dim=0)


def sum_reports(
    reports: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> tuple[Tensor, Tensor]:
    """``(loss_sum, denominator)`` added up over reports, on this rank; no collective.

    Args:
        reports: One report or a sequence of them (one per micro-batch, say), each holding
            :data:`REPORT_KEY` (or :data:`NEMO_REPORT_KEY`): a ``[2]`` tensor, or ``[..., 2]``
            summed over its leading dims.

    Returns:
        0-dim fp64 ``loss_sum`` and ``denominator``. An empty sequence gives zeros on the
        current device.

    Raises:
        TypeError: When ``reports`` is not a report or a sequence of them, or a value is not a
            tensor (the message names the report's index).
        KeyError: When a report has neither key (the message lists its keys).
        ValueError: When a value's last dim is not 2.
    """
    if isinstance(reports, Mapping):
        reports = [reports]
    if isinstance(reports, str | bytes) or not isinstance(reports, Sequence):
        raise TypeError(
            f"Expected a loss report (a mapping with key {REPORT_KEY!r}) or a sequence of them, "
            f"got {type(reports).__name__}."
        )
    if len(reports) == 0:
        zero = torch.zeros((), dtype=torch.float64, device=distributed.default_device())
        return zero, zero.clone()
    pairs = [_report_pair(index, report) for index, report in enumerate(reports)]
    loss_sum, denominator = torch.stack(pairs).sum(dim=0).unbind()
    return loss_sum, denominator


def reduce_reports(
    reports: Sequence[Mapping[str, Any]], group: dist.ProcessGroup | None = None
) -> Tensor:
    """The exact mean loss of the global batch, from this rank's reports: one all-reduce.

    ``global_loss_sum / global_denominator`` (0.0 when that is 0): the local sums, one
    all-reduce over ``group``, one division. Legacy :class:`SameSizeLossDict` reports (all of
    them ``avg``) are averaged as NeMo does, without a collective.

    Args:
        reports: One report per micro-batch of this rank's step; may be empty (a non-last
            pipeline stage, say, whose whole group has none), which gives 0.0 on the current
            device without a collective.
        group: The ranks whose sums make up the global batch;
            :func:`bert_reduce.distributed.loss_reduction_group` when ``None``.

    Returns:
        A 0-dim fp64 tensor (the legacy reports' dtype for those).

    Raises:
        ValueError: If per-token and legacy reports are mixed.
        TypeError, KeyError: On a malformed report, as :func:`sum_reports`.
    """
    if len(reports) == 0:
        return torch.zeros((), dtype=torch.float64, device=distributed.default_device())
    has_avg = [isinstance(report, Mapping) and "avg" in report for report in reports]
    if all(has_avg):
        return torch.cat([report["avg"].reshape(1) for report in reports]).mean()
    if any(has_avg) and not all(
        isinstance(r, Mapping) and (REPORT_KEY in r or NEMO_REPORT_KEY in r) for r in reports
    ):
        raise ValueError(
            f"Cannot reduce these reports: expected all with {REPORT_KEY!r} (or "
            f"{NEMO_REPORT_KEY!r}) or all with 'avg', got keys "
            f"{[sorted(r) if isinstance(r, Mapping) else type(r).__name__ for r in reports]}."
        )
    local = torch.stack(sum_reports(reports))
    group = distributed.loss_reduction_group() if group is None else group
    loss_sum, denominator = distributed.all_reduce_sum_(local, group).unbind()
    return safe_divide(loss_sum, denominator)
