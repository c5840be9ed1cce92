"""NeMo's own loss reports (``loss_sum_and_ub_size``, NeMo's ``MaskedTokenLossReduction``)
reduce through bert_reduce, mixed with bert_reduce's in one step."""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import torch
import torch.nn.functional as F
from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.metrics import TokenPerplexity
from tests.helpers.megatron_cpu import single_process_megatron
from tests.helpers.reference import make_mlm_batch, reference_loss


def test_nemo_reports_mix_with_bert_reduce_reports() -> None:
    logits, labels, mask = make_mlm_batch(6, 8, 11, empty_rows=(3,))
    ref = reference_loss(logits, labels, mask)
    reports = []
    with single_process_megatron():
        for rows, produced_by_nemo in (
            (slice(0, 2), True),
            (slice(2, 4), False),
            (slice(4, 6), True),
        ):
            batch = {"labels": labels[rows], "loss_mask": mask[rows]}
            if produced_by_nemo:
                per_token = F.cross_entropy(
                    logits[:, rows].permute(1, 2, 0), labels[rows].clamp(min=0), reduction="none"
                )
                nemo_loss = MaskedTokenLossReduction()
                nemo_loss.setup(batch)
                _, _, report = nemo_loss(per_token)
                assert set(report) == {"loss_sum_and_ub_size"}
            else:
                loss_fn = BERTMLMLossWithReduction()
                loss_fn.setup(batch)
                _, _, report = loss_fn({"token_logits": logits[:, rows]})
            reports.append(report)
        reduced = BERTMLMLossWithReduction().reduce(reports)
    torch.testing.assert_close(reduced, ref.float(), rtol=1e-6, atol=0)
    metric = TokenPerplexity()
    metric.update_from_reports(reports)
    torch.testing.assert_close(metric.compute(), ref.exp(), rtol=1e-6, atol=0)
