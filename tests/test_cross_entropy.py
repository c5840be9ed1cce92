from __future__ import annotations

import contextlib
import math

import pytest
import torch

from bert_reduce._vocab_parallel import resolve_capacity
from bert_reduce.cross_entropy import cross_entropy_loss_sum
from tests.helpers.reference import make_mlm_batch, reference_loss_and_grad
from tests.helpers.sync_guard import HostSyncError, count_collectives, forbid_host_syncs

# Small chunks, so that every test also crosses chunk boundaries.
CHUNK = 3 * 13


def run(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss sum, denominator and gradient of cross_entropy_loss_sum on non-leaf logits.

    Every capacity but ``"nonzero"`` runs with no host sync and no collective.
    """
    leaf = logits.detach().clone().requires_grad_(True)
    syncs = contextlib.nullcontext() if kwargs.get("capacity") == "nonzero" else forbid_host_syncs()
    with syncs, count_collectives() as calls:
        loss_sum, num_tokens = cross_entropy_loss_sum(leaf * 1, labels, mask, **kwargs)
        loss_sum.backward()
    assert leaf.grad is not None and sum(calls.values()) == 0
    return loss_sum.detach(), num_tokens, leaf.grad


CAPACITIES = ["all", "nonzero", 15, 0.5, 1.0]


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("batch", ["one empty row", "all empty", "-inf logits"])
def test_matches_dense_cross_entropy_fp64(capacity, in_place, weighted, batch) -> None:
    empty_rows = (0, 1, 2, 3) if batch == "all empty" else (2,)
    logits, labels, mask = make_mlm_batch(4, 9, 13, mask_prob=0.3, empty_rows=empty_rows)
    assert int(mask.sum()) <= 15
    if batch == "-inf logits":  # like banned tokens, never a scored label
        logits[..., :3] = -torch.inf
        labels = torch.where(mask, labels.clamp(min=3), labels)
    if weighted:
        mask = mask * torch.rand(mask.shape, dtype=torch.float64)
    loss, count, grad = run(
        logits, labels, mask, capacity=capacity, in_place=in_place, chunk_elements=CHUNK
    )
    ref_loss, ref_grad = reference_loss_and_grad(logits, labels, mask, "sum")
    assert ref_loss.isfinite()
    assert loss.dtype == torch.float64 and grad.dtype == torch.float64
    # The denominator is the sum of the weights (token_denominator): the count for a 0/1 mask.
    assert count.dtype == (torch.float64 if weighted else torch.int64)
    torch.testing.assert_close(count, mask.sum().to(count.dtype), rtol=1e-15, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    unscored = (mask == 0).transpose(0, 1)
    assert torch.equal(grad[unscored], torch.zeros_like(grad[unscored]))


@pytest.mark.parametrize("capacity", ["all", 0.5])
def test_gradcheck_with_float_weights(capacity) -> None:
    logits, labels, mask = make_mlm_batch(2, 5, 6, mask_prob=0.4)
    weights = mask * torch.rand(mask.shape, dtype=torch.float64)
    leaf = logits.clone().requires_grad_(True)

    def loss_sum(x: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss_sum(x, labels, weights, capacity=capacity, chunk_elements=12)[0]

    # fast_mode: the Jacobian against random projections, which any wrong entry fails.
    assert torch.autograd.gradcheck(loss_sum, (leaf,), fast_mode=True)


@pytest.mark.parametrize("capacity", ["all", "nonzero", 0.5])
def test_non_contiguous_logits_and_caller_logits_untouched(capacity) -> None:
    logits, labels, mask = make_mlm_batch(6, 8, 11)
    rows = slice(1, 4)
    view = logits[:, rows]
    assert not view.is_contiguous()
    before = logits.clone()
    leaf_view = logits.clone().requires_grad_(True)
    loss_sum, _ = cross_entropy_loss_sum(
        leaf_view[:, rows], labels[rows], mask[rows], capacity=capacity, chunk_elements=CHUNK
    )
    loss_sum.backward()
    ref_loss, ref_grad = reference_loss_and_grad(view, labels[rows], mask[rows], "sum")
    torch.testing.assert_close(loss_sum, ref_loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(leaf_view.grad[:, rows], ref_grad, rtol=1e-12, atol=1e-15)
    assert torch.equal(leaf_view.detach(), before)


def test_in_place_writes_the_gradient_into_the_logits() -> None:
    logits, labels, mask = make_mlm_batch(4, 8, 9, dtype=torch.float32)
    leaf = logits.clone().requires_grad_(True)
    buffer = leaf * 1
    grads: list[torch.Tensor] = []
    buffer.register_hook(grads.append)
    loss_sum, _ = cross_entropy_loss_sum(buffer, labels, mask, capacity=0.5, in_place=True)
    loss_sum.backward()
    assert grads[0].data_ptr() == buffer.data_ptr()
    _, ref_grad = reference_loss_and_grad(logits, labels, mask, "sum")
    torch.testing.assert_close(buffer.detach(), ref_grad.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("in_place", [False, True])
def test_bf16_accumulates_in_fp32(in_place) -> None:
    logits, labels, mask = make_mlm_batch(4, 32, 33)
    loss, _, grad = run(logits.bfloat16(), labels, mask, capacity=0.5, in_place=in_place)
    ref_loss, ref_grad = reference_loss_and_grad(logits.bfloat16(), labels, mask, "sum")
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("in_place", [False, True])
def test_capacity_overflow_is_nan_in_loss_and_gradient_without_sync(in_place) -> None:
    logits, labels, mask = make_mlm_batch(4, 9, 13, mask_prob=0.5)
    count = int(mask.sum())
    loss_sum, _, grad = run(logits, labels, mask, capacity=count - 1, in_place=in_place)
    assert loss_sum.isnan()
    assert grad.isnan().any()
    exact, _ = cross_entropy_loss_sum(logits, labels, mask, capacity=count)
    assert not exact.isnan()


def test_masked_label_outside_vocab_is_nan_unmasked_is_ignored() -> None:
    logits, labels, mask = make_mlm_batch(2, 8, 9)
    assert (labels[~mask] == -100).all()
    assert not cross_entropy_loss_sum(logits, labels, mask)[0].isnan()
    labels[mask.nonzero()[0].unbind()] = 9
    for capacity in CAPACITIES:
        assert cross_entropy_loss_sum(logits, labels, mask, capacity=capacity)[0].isnan()


def test_nonzero_capacity_syncs_as_documented() -> None:
    logits, labels, mask = make_mlm_batch(4, 8, 9)
    with forbid_host_syncs(), pytest.raises(HostSyncError, match="__int__"):
        cross_entropy_loss_sum(logits, labels, mask, capacity="nonzero")


def test_resolve_capacity() -> None:
    assert resolve_capacity("all", 4096) == 4096
    assert resolve_capacity("nonzero", 4096) is None
    assert resolve_capacity(0.2, 4096) == math.ceil(0.2 * 4096) == 820
    assert resolve_capacity(5000, 4096) == 4096
    assert resolve_capacity(0, 10) == 0
    for bad, match in [("some", "capacity must be"), (0.0, r"\(0, 1\]"), (1.5, r"\(0, 1\]")]:
        with pytest.raises(ValueError, match=match):
            resolve_capacity(bad, 10)
    with pytest.raises(ValueError, match="non-negative"):
        resolve_capacity(-1, 10)
    with pytest.raises(ValueError, match="capacity must be"):
        resolve_capacity(True, 10)


def test_errors_name_the_shapes_and_arguments() -> None:
    logits, labels, mask = make_mlm_batch(2, 8, 9)
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 8\)"):
        cross_entropy_loss_sum(logits, labels, mask[:, :4])
    with pytest.raises(ValueError, match=r"\(8, 2, 9\).*\(2, 7\)"):
        cross_entropy_loss_sum(logits, labels[:, :7], mask[:, :7])
    with pytest.raises(ValueError, match="chunk_elements"):
        cross_entropy_loss_sum(logits, labels, mask, chunk_elements=0)
    with pytest.raises(ValueError, match="leaf"):
        cross_entropy_loss_sum(logits.requires_grad_(True), labels, mask, in_place=True)


@pytest.mark.parametrize(("shard", "tp_size"), [(7, 2), (5, 4)])
def test_vocab_ranges_follow_megatron(shard, tp_size) -> None:
    from megatron.core.tensor_parallel.utils import VocabUtility

    from bert_reduce._vocab_parallel import vocab_start

    for rank in range(tp_size):
        start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(shard, rank, tp_size)
        assert vocab_start(shard, rank, tp_size) == start
