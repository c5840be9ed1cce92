from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bert_reduce import masked_token_loss, unreduced_token_loss_fn
from bert_reduce.functional import safe_divide, validate_masked_labels
from tests.helpers.reference import make_mlm_batch


def test_unreduced_token_loss_matches_cross_entropy_fp64_and_is_nan_out_of_vocab() -> None:
    logits, labels, _ = make_mlm_batch(3, 7, 11, mask_prob=1.0)
    per_token = unreduced_token_loss_fn(logits, labels)
    expected = F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    assert per_token.shape == (3, 7) and per_token.dtype == torch.float64
    torch.testing.assert_close(per_token, expected, rtol=1e-12, atol=1e-12)
    labels[1, 2], labels[0, 0] = 11, -100
    assert unreduced_token_loss_fn(logits, labels).isnan().nonzero().tolist() == [[0, 0], [1, 2]]


def test_masked_token_loss_count_exact_beyond_fp32() -> None:
    # 2**24 + 1 is not representable in fp32: a float count would be off by one.
    n = 2**24 + 1
    _, count = masked_token_loss(torch.zeros(1, n), torch.ones(1, n, dtype=torch.bool))
    assert count.dtype == torch.int64 and count.item() == n


def test_safe_divide_zero_denominator_and_gradient() -> None:
    num = torch.tensor([3.0, 2.0], requires_grad=True)
    out = safe_divide(num, torch.tensor([0, 4]))
    out.sum().backward()
    assert out.tolist() == [0.0, 0.5]
    assert num.grad.tolist() == [0.0, 0.25]


@pytest.mark.parametrize(
    ("logits_shape", "labels_shape", "labels_dtype", "match"),
    [
        ((4, 2, 5), (4, 2), torch.long, r"\(4, 2, 5\) must be \[s, b, v\] = \[2, 4, v\].*\(4, 2\)"),
        ((4, 2), (2, 4), torch.long, r"\(4, 2\) must be \[s, b, v\]"),
        ((4, 2, 5), (2, 4, 1), torch.long, r"\[b, s\], got shape \(2, 4, 1\)"),
        ((3, 2, 4), (2, 3), torch.float32, "integer token ids"),
    ],
)
def test_logits_and_labels_errors_name_both(
    logits_shape, labels_shape, labels_dtype, match
) -> None:
    with pytest.raises(ValueError, match=match):
        unreduced_token_loss_fn(
            torch.zeros(logits_shape), torch.zeros(labels_shape, dtype=labels_dtype)
        )
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        masked_token_loss(torch.zeros(2, 3), torch.zeros(3, 2))


def test_validate_masked_labels() -> None:
    labels = torch.tensor([[0, 9, -100], [3, 4, 1]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    with pytest.raises(
        ValueError, match=r"1 masked label\(s\) outside \[0, 5\); first at \[b=0, s=1\]: 9"
    ):
        validate_masked_labels(labels, mask, vocab_size=5)
    validate_masked_labels(labels, mask, vocab_size=10)
