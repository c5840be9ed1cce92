"""Collectives and host syncs per training step of the whole loss reduction, in a real DP run."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from bert_reduce import BERTMLMLossWithReduction
from tests.helpers.dist_utils import run_distributed
from tests.helpers.mode_reference import checked_reduce
from tests.helpers.reference import make_mlm_batch, reference_loss_and_grad
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

SIZES = {0: [2, 1], 1: [1, 2]}  # unequal micro-batches on each of the two DP ranks


def _training_step(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, **loss_kwargs
) -> tuple[Counter[str], Counter[str], torch.Tensor, torch.Tensor]:
    """One step as Megatron's schedule drives it, on this rank's samples.

    Returns the collectives of all micro-batches' forward+backward, those of ``reduce``, the
    reduced loss, and the summed gradient w.r.t. ``logits``.
    """
    leaf = logits.detach().clone().requires_grad_(True)
    reports, start = [], 0
    with count_collectives() as forward_calls:
        for size in SIZES[dist.get_rank()]:
            rows = slice(start, start + size)
            start += size
            loss_fn = BERTMLMLossWithReduction(**loss_kwargs)
            loss_fn.setup({"labels": labels[rows], "loss_mask": mask[rows]})
            loss_sum, _, report = loss_fn({"token_logits": leaf[:, rows]})
            loss_sum.backward()
            reports.append(report)
    with count_collectives() as reduce_calls:
        BERTMLMLossWithReduction(**loss_kwargs).reduce(reports)
    reduced = checked_reduce(reports)
    assert leaf.grad is not None
    return forward_calls, reduce_calls, reduced, leaf.grad


def _data_parallel_body() -> None:
    logits, labels, mask = make_mlm_batch(6, 10, 11, mask_prob=0.25, empty_rows=(2,), seed=5)
    ref_loss, ref_grad = reference_loss_and_grad(logits, labels, mask)
    global_count = mask.sum()
    mine = slice(3 * dist.get_rank(), 3 * dist.get_rank() + 3)
    local = (logits[:, mine], labels[mine], mask[mine])

    for capacity in ["all", 0.7]:
        with forbid_host_syncs():
            forward_calls, reduce_calls, reduced, grad = _training_step(*local, capacity=capacity)
        assert dict(forward_calls) == {}, (capacity, dict(forward_calls))
        assert dict(reduce_calls) == {"all_reduce": 1}, (capacity, dict(reduce_calls))
        torch.testing.assert_close(reduced, ref_loss, rtol=1e-12, atol=0)
        # Megatron's schedule divides the summed gradients by the global token count.
        torch.testing.assert_close(grad / global_count, ref_grad[:, mine], rtol=1e-12, atol=1e-15)

    # The counter sees Megatron-Core's path: three all-reduces per micro-batch, even at TP = 1.
    forward_calls, reduce_calls, reduced, _ = _training_step(*local, cross_entropy="megatron")
    assert dict(forward_calls) == {"all_reduce": 3 * len(SIZES[dist.get_rank()])}
    assert dict(reduce_calls) == {"all_reduce": 1}
    torch.testing.assert_close(reduced, ref_loss, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_data_parallel_step_forward_no_collective_reduce_one_no_host_sync() -> None:
    run_distributed(_data_parallel_body, 2)
