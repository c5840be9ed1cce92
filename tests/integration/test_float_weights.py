"""Weighted loss masks give the same loss on every path, and ``val_ppl = exp(val_loss)``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from bert_reduce import (
    BERTMLMLossWithReduction,
    TokenPerplexity,
    cross_entropy_loss_sum,
    masked_token_loss,
    unreduced_token_loss_fn,
)
from bert_reduce.lightning import ValidationPerplexityCallback
from bert_reduce.reports import reduce_reports
from tests.helpers.perplexity_helpers import MLMSamples, TinyMLM, assert_matches_reference
from tests.helpers.reference import make_mlm_batch, reference_loss
from tests.helpers.tiny_lightning import quiet_trainer as trainer

SPLIT = (slice(0, 3), slice(3, 4), slice(4, 6))


def _weighted(mask: Tensor, kind: str) -> Tensor:
    """0.5 everywhere, integer 2s, or fractional weights whose sum is not an integer."""
    if kind == "half":
        return mask * 0.5
    if kind == "twos":
        return mask.long() * 2
    gen = torch.Generator().manual_seed(3)
    return mask * (0.05 + torch.rand(mask.shape, generator=gen, dtype=torch.float64))


KINDS = ["half", "twos", "fractional"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_path_gives_the_weighted_mean(kind) -> None:
    logits, labels, mask = make_mlm_batch(6, 9, 13, mask_prob=0.4, empty_rows=(3,))
    weights = _weighted(mask, kind)
    if kind == "fractional":
        assert float(weights.sum()) % 1 > 0.01  # rounding it to an integer would show
    expected = reference_loss(logits, labels, weights, "per_token")

    # (Megatron-Core's kernels, at fp32, on float weights: tests/test_engine.py.)
    results: dict[str, Tensor] = {}
    reports = []
    for rows in SPLIT:
        loss_fn = BERTMLMLossWithReduction()
        loss_fn.setup({"labels": labels[rows], "loss_mask": weights[rows]})
        reports.append(loss_fn({"token_logits": logits[:, rows]})[2])
    results["reduce"] = reduce_reports(reports)

    sums = [cross_entropy_loss_sum(logits[:, r], labels[r], weights[r]) for r in SPLIT]
    results["cross_entropy_loss_sum"] = sum(s for s, _ in sums) / sum(d for _, d in sums)
    sums = [
        masked_token_loss(unreduced_token_loss_fn(logits[:, r], labels[r]), weights[r])
        for r in SPLIT
    ]
    results["masked_token_loss"] = sum(s for s, _ in sums) / sum(d for _, d in sums)

    from_logits, from_reports, from_list = TokenPerplexity(), TokenPerplexity(), TokenPerplexity()
    for rows, report in zip(SPLIT, reports, strict=True):
        from_logits.update_from_logits(logits[:, rows], labels[rows], weights[rows])
        from_reports.update_from_reports(report)
    from_list.update_from_reports(reports)
    results["log TokenPerplexity(logits)"] = from_logits.compute().log()
    results["log TokenPerplexity(reports)"] = from_reports.compute().log()
    results["log TokenPerplexity(a list of reports)"] = from_list.compute().log()

    for path, value in results.items():
        torch.testing.assert_close(
            value.to(torch.float64), expected, rtol=1e-12, atol=0, msg=lambda m, p=path: f"{p}: {m}"
        )


@pytest.mark.parametrize("kind", KINDS)
def test_validation_callback_reports_the_weighted_mean_and_its_exp(kind) -> None:
    data = MLMSamples(11)
    data.loss_mask = _weighted(data.loss_mask, kind)
    model = TinyMLM(seed=2)
    callback = ValidationPerplexityCallback()
    trainer([callback]).validate(model, DataLoader(data, 4), verbose=False)
    assert_matches_reference(callback, model, data)
