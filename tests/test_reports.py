"""The report format: one summer, NeMo's key as an alias, clear errors on malformed reports."""

from __future__ import annotations

import pytest
import torch

from bert_reduce.reports import (
    NEMO_REPORT_KEY,
    REPORT_KEY,
    make_report,
    reduce_reports,
    sum_reports,
)


def test_make_report_is_detached_fp64_pair() -> None:
    loss_sum = torch.tensor(2.5, dtype=torch.float32, requires_grad=True)
    report = make_report(loss_sum * 2, torch.tensor(3))
    assert report.dtype == torch.float64 and not report.requires_grad
    assert report.tolist() == [5.0, 3.0]


def test_nemo_key_is_an_alias_and_fractional_denominators_are_kept() -> None:
    ours = {REPORT_KEY: torch.tensor([6.0, 2.5], dtype=torch.float64)}
    # NeMo/BioNeMo build theirs with torch.cat of a float sum and an int count.
    nemo = {NEMO_REPORT_KEY: torch.cat([torch.tensor([3.0]), torch.tensor([1])])}
    loss_sum, denominator = sum_reports([ours, nemo])
    assert (loss_sum.item(), denominator.item()) == (9.0, 3.5)
    assert denominator.dtype == torch.float64
    assert reduce_reports([ours, nemo]).item() == pytest.approx(9.0 / 3.5, rel=1e-15)


def test_stacked_reports_sum_over_leading_dims() -> None:
    stacked = {REPORT_KEY: torch.tensor([[1.0, 1.0], [2.0, 3.0]])}
    assert [t.item() for t in sum_reports(stacked)] == [3.0, 4.0]


def test_empty_and_legacy_reports() -> None:
    assert reduce_reports([]).item() == 0.0
    assert [t.item() for t in sum_reports([])] == [0.0, 0.0]
    legacy = [{"avg": torch.tensor([1.0])}, {"avg": torch.tensor(3.0)}]
    assert reduce_reports(legacy).item() == 2.0


def test_malformed_reports_are_named() -> None:
    # Mixed legacy reports, a string report, a [3] report: tests/integration/test_bad_inputs.py.
    with pytest.raises(TypeError, match=r"or a sequence of them, got str"):
        sum_reports("loss_sum_and_microbatch_size")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"report 0 has no .* \(a legacy mean"):
        sum_reports([{"avg": torch.tensor(1.0)}])
    with pytest.raises(TypeError, match=r"report 0\['loss_sum_and_ub_size'\] must be a torch"):
        sum_reports([{NEMO_REPORT_KEY: [1.0, 2.0]}])
    with pytest.raises(ValueError, match=r"must have shape \[2\] or \[\.\.\., 2\].*got \(\)"):
        sum_reports([{REPORT_KEY: torch.tensor(1.0)}])
