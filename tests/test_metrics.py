"""TokenPerplexity and its functional core against one-pass references.

References: ``exp(F.cross_entropy)`` over every masked token of the whole, unsplit batch, and
``torchmetrics.text.Perplexity`` on the full logits.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torchmetrics.text import Perplexity

from bert_reduce import TokenPerplexity
from bert_reduce.metrics import perplexity_from_sums
from tests.helpers.memory import peak_allocated_bytes
from tests.helpers.reference import UNEVEN_MICRO_BATCHES, reference_loss, uneven_mlm_batch
from tests.helpers.sync_guard import forbid_host_syncs


def test_perplexity_from_sums_is_exp_of_mean_and_one_when_empty() -> None:
    loss_sum = torch.tensor([6.0, 0.0, 2.5], dtype=torch.float64)
    count = torch.tensor([3, 0, 5])
    expected = torch.tensor([2.0, 0.0, 0.5], dtype=torch.float64).exp()
    torch.testing.assert_close(perplexity_from_sums(loss_sum, count), expected, rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=r"loss_sum of shape \(3,\) and denominator of shape \(2,\) must"
    ):
        perplexity_from_sums(loss_sum, count[:2])


def test_micro_batches_equal_one_pass_reference_and_torchmetrics() -> None:
    logits, labels, mask = uneven_mlm_batch()
    metric = TokenPerplexity()
    for rows in UNEVEN_MICRO_BATCHES:
        metric.update_from_logits(logits[:, rows], labels[rows], mask[rows])
    expected = reference_loss(logits, labels, mask).exp()
    torch.testing.assert_close(metric.compute(), expected, rtol=1e-12, atol=0)
    torchmetrics = Perplexity(ignore_index=-100).set_dtype(torch.float64)
    torchmetrics.update(logits.transpose(0, 1), labels)
    torch.testing.assert_close(metric.compute(), torchmetrics.compute())
    assert int(metric.denominator) == int(mask.sum())
    assert metric.loss_sum.dtype == torch.float64 and metric.denominator.dtype == torch.float64

    # Averaging per-micro-batch perplexities is not the perplexity of the batch.
    per_batch = []
    for rows in UNEVEN_MICRO_BATCHES:
        if mask[rows].any():
            per_batch.append(reference_loss(logits[:, rows], labels[rows], mask[rows]).exp())
    assert abs(float(torch.stack(per_batch).mean() - expected)) > 1e-2


@pytest.mark.slow  # 130M logits per dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_update_from_logits_needs_a_tenth_of_the_logits_and_gives_the_same_perplexity(
    dtype,
) -> None:
    # An ESM-2-sized step: [512, 8, 32000] logits, 15% scored. The previous path (a full
    # log-softmax in fp32) allocated 1.0x the logits' bytes in fp32 and 4.0x in bf16.
    seq_len, batch_size, vocab = 512, 8, 32000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(seq_len, batch_size, vocab, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    mask = torch.rand(batch_size, seq_len, generator=gen) < 0.15
    metric = TokenPerplexity()
    peak = peak_allocated_bytes(lambda: metric.update_from_logits(logits, labels, mask))
    assert peak <= 0.1 * logits.numel() * logits.element_size(), peak
    # The previous definition: fp32 log-softmax of the logits, summed over the scored tokens.
    rows = logits.transpose(0, 1)[mask].to(torch.float32)
    before = torch.nn.functional.cross_entropy(rows, labels[mask], reduction="sum")
    torch.testing.assert_close(metric.loss_sum, before.double(), rtol=1e-6, atol=0)
    assert int(metric.denominator) == int(mask.sum())


def test_empty_state_is_one_never_nan() -> None:
    metric = TokenPerplexity()
    with pytest.warns(UserWarning, match="called before the ``update``"):
        assert float(metric.compute()) == 1.0
    logits, labels, mask = uneven_mlm_batch()
    metric.update_from_logits(logits[:, [5]], labels[[5]], mask[[5]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = metric.compute()
    assert float(value) == 1.0 and value.dtype == torch.float64
    assert int(metric.denominator) == 0


def test_update_runs_no_host_sync_keeps_no_logits_nor_graph() -> None:
    logits, labels, mask = uneven_mlm_batch(torch.float32)
    logits.requires_grad_(True)
    before = logits.detach().clone()
    metric = TokenPerplexity()
    with forbid_host_syncs():
        for rows in UNEVEN_MICRO_BATCHES:
            metric.update_from_logits(logits[:, rows], labels[rows], mask[rows])
        value = metric.compute()
    assert torch.equal(logits.detach(), before)
    tensors = [v for v in vars(metric).values() if isinstance(v, torch.Tensor)]
    tensors += list(metric.metric_state.values())
    assert all(t.dim() == 0 and t.grad_fn is None and not t.requires_grad for t in tensors)
    assert value.grad_fn is None
    torch.testing.assert_close(value, reference_loss(before, labels, mask).exp(), rtol=1e-6, atol=0)


def test_errors_name_keys_and_shapes() -> None:
    metric = TokenPerplexity()
    with pytest.raises(ValueError, match=r"loss_sum of shape \(2,\) and denominator of shape \(\)"):
        metric.update(torch.zeros(2), torch.tensor(1))
    with pytest.raises(TypeError, match=r"or a sequence of them, got Tensor"):
        metric.update_from_reports(torch.zeros(2))  # type: ignore[arg-type]
    logits, labels, mask = uneven_mlm_batch()
    with pytest.raises(
        ValueError, match=r"loss_mask of shape \(7, 5\) and labels of shape \(7, 10\)"
    ):
        metric.update_from_logits(logits, labels, mask[:, :5])
    with pytest.raises(ValueError, match=r"labels must be \[b, s\], got shape \(10,\)"):
        metric.update_from_logits(logits, labels[0], mask[0])
