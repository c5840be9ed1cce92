from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bert_reduce import masked_token_loss, unreduced_token_loss_fn
from bert_reduce.functional import safe_divide, validate_masked_labels
from tests.helpers.reference import make_mlm_batch


def test_unreduced_token_loss_matches_cross_entropy_fp64() -> None:
    logits, labels, _ = make_mlm_batch(3, 7, 11, mask_prob=1.0)
    per_token = unreduced_token_loss_fn(logits, labels)
    expected = F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    assert per_token.shape == (3, 7)
    assert per_token.dtype == torch.float64
    torch.testing.assert_close(per_token, expected, rtol=1e-12, atol=1e-12)


def test_unreduced_token_loss_leaves_logits_untouched() -> None:
    logits, labels, _ = make_mlm_batch(2, 5, 9, dtype=torch.float32)
    before = logits.clone()
    unreduced_token_loss_fn(logits, labels)
    assert torch.equal(logits, before)


def test_out_of_vocab_label_is_nan_not_silently_wrong() -> None:
    logits, labels, _ = make_mlm_batch(2, 4, 5, mask_prob=1.0)
    labels[1, 2] = 5
    labels[0, 0] = -100
    per_token = unreduced_token_loss_fn(logits, labels)
    assert per_token[1, 2].isnan() and per_token[0, 0].isnan()
    assert per_token.isnan().sum() == 2


def test_masked_token_loss_sum_and_exact_int64_count() -> None:
    per_token = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 8.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]])
    loss_sum, count = masked_token_loss(per_token, mask)
    assert loss_sum.item() == 11.0
    assert count.dtype == torch.int64 and count.item() == 3


def test_masked_token_loss_count_exact_beyond_fp32() -> None:
    # 2**24 + 1 is not representable in fp32: a float count would be off by one.
    n = 2**24 + 1
    per_token = torch.zeros(1, n)
    mask = torch.ones(1, n, dtype=torch.bool)
    _, count = masked_token_loss(per_token, mask)
    assert count.item() == n


def test_masked_token_loss_empty_mask_is_zero_with_zero_grad() -> None:
    logits, labels, mask = make_mlm_batch(2, 6, 7, empty_rows=(0, 1))
    logits.requires_grad_(True)
    loss_sum, count = masked_token_loss(unreduced_token_loss_fn(logits, labels), mask)
    loss_sum.backward()
    assert loss_sum.item() == 0.0 and count.item() == 0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_safe_divide_zero_denominator_and_gradient() -> None:
    num = torch.tensor([3.0, 2.0], requires_grad=True)
    out = safe_divide(num, torch.tensor([0, 4]))
    out.sum().backward()
    assert out.tolist() == [0.0, 0.5]
    assert num.grad.tolist() == [0.0, 0.25]


@pytest.mark.parametrize(
    ("logits_shape", "labels_shape", "match"),
    [
        ((4, 2, 5), (4, 2), r"\(4, 2, 5\).*\(4, 2\).*expected labels of shape \(2, 4\)"),
        ((4, 2), (2, 4), r"\[s, b, v\], got \(4, 2\)"),
        ((4, 2, 5), (2, 4, 1), r"\[b, s\], got \(2, 4, 1\)"),
    ],
)
def test_shape_errors_name_both_shapes(logits_shape, labels_shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        unreduced_token_loss_fn(
            torch.zeros(logits_shape), torch.zeros(labels_shape, dtype=torch.long)
        )


def test_masked_token_loss_shape_error() -> None:
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        masked_token_loss(torch.zeros(2, 3), torch.zeros(3, 2))


def test_float_labels_rejected() -> None:
    with pytest.raises(ValueError, match="integer token ids"):
        unreduced_token_loss_fn(torch.zeros(3, 2, 4), torch.zeros(2, 3))


def test_validate_masked_labels() -> None:
    labels = torch.tensor([[0, 9, -100], [3, 4, 1]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    with pytest.raises(
        ValueError, match=r"1 masked label\(s\) outside \[0, 5\); first at \[b=0, s=1\]: 9"
    ):
        validate_masked_labels(labels, mask, vocab_size=5)
    validate_masked_labels(labels, mask, vocab_size=10)
