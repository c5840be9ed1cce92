"""The normalization modes' options and weights, and bert_reduce driven over micro-batches, to
compare with ``tests.helpers.reference``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.reports import reduce_reports

MODES = ("per_token", "per_sequence", "constant")


def mode_kwargs(mode: str, constant_per_sequence: int = 10) -> dict[str, int]:
    return {"constant_per_sequence": constant_per_sequence} if mode == "constant" else {}


def float_weights(mask: Tensor, seed: int = 1, dyadic: bool = False) -> Tensor:
    """``[b, s]`` fp64 weights where ``mask`` scores, 0 elsewhere: in ``[0.1, 2.1)``, or dyadic
    (multiples of 1/4, exact under ``weight_resolution=256``)."""
    gen = torch.Generator().manual_seed(seed)
    if dyadic:
        choices = torch.tensor([0.25, 0.5, 1.0, 1.5, 2.75], dtype=torch.float64)
        weights = choices[torch.randint(0, 5, mask.shape, generator=gen)]
    else:
        weights = torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 2 + 0.1
    return torch.where(mask, weights, 0)


def checked_reduce(reports: Sequence[Any]) -> Tensor:
    """``BERTMLMLossWithReduction().reduce(reports)``, checked to be ``reduce_reports``' fp64
    quotient cast to float32 (as its docstring says); returns the fp64 quotient, for fp64
    tolerances."""
    exact = reduce_reports(reports)
    reduced = BERTMLMLossWithReduction().reduce(reports)
    assert reduced.dtype == torch.float32
    assert torch.equal(reduced, exact.to(torch.float32))
    return exact


def run_mode_microbatches(
    logits: Tensor,
    labels: Tensor,
    mask: Tensor,
    sizes: Sequence[int],
    **loss_kwargs,
) -> tuple[Tensor, Tensor]:
    """Drive ``BERTMLMLossWithReduction`` over row micro-batches as Megatron does.

    Returns ``reduce``'s loss and the gradient Megatron's ``calculate_per_token_loss=True``
    gives: d(sum of numerators) / (sum of denominators), nothing when that sum is 0.
    """
    assert sum(sizes) == labels.shape[0]
    logits = logits.detach().requires_grad_(True)
    reports, total, start = [], torch.zeros((), dtype=torch.float64), 0
    for size in sizes:
        rows = slice(start, start + size)
        start += size
        loss_fn = BERTMLMLossWithReduction(**loss_kwargs)
        loss_fn.setup({"labels": labels[rows], "loss_mask": mask[rows]})
        numerator, denominator, report = loss_fn({"token_logits": logits[:, rows]})
        numerator.backward()
        total += denominator
        reports.append(report)
    reduced = checked_reduce(reports)
    assert logits.grad is not None
    grad = logits.grad / total if total != 0 else logits.grad
    return reduced, grad
