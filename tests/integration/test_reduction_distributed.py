"""Real multi-process runs: every DP, TP (vocab-sharded logits) and CP layout against one process.

One spawn of 4 processes goes through the layouts: plain ``torch.distributed`` (DP = 4), then
Megatron-Core's parallel state at DP = 4, DP = 2 x TP = 2, TP = 4, DP = 2 x CP = 2 and
TP = 2 x CP = 2, rebuilt for each. Every rank builds the same global batch, takes its share
(rows for DP, load-balanced sequence chunks for CP, a vocab slice for TP), runs the loss per
micro-batch as Megatron would, counting its collectives and host syncs, and checks the reduced
loss and its own slice of d(loss)/d(logits) against ``F.cross_entropy`` on the whole, unsplit
batch. Megatron's own cross-entropy kernels run at TP = 1, 2 and 4; ``cross_entropy_loss_sum`` on
vocab shards through a group passed in (no Megatron) and Megatron's TP group; ``TokenPerplexity``
in every layout without CP; a packed batch in every mode at DP = 2 x CP = 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce import (
    BERTMLMLossWithReduction,
    TokenPerplexity,
    cross_entropy_loss_sum,
    get_batch_on_this_cp_rank,
    unreduced_token_loss_fn,
)
from bert_reduce import distributed as brd
from bert_reduce.context_parallel import (
    get_packed_batch_on_this_cp_rank,
    slice_for_context_parallel,
)
from bert_reduce.distributed import all_reduce_sum_, loss_reduction_group
from bert_reduce.packing import unpack_sequences
from tests.helpers.dist_utils import megatron_parallel_state, run_distributed
from tests.helpers.mode_reference import MODES, checked_reduce, mode_kwargs
from tests.helpers.packed_batch import RAGGED_SEQ_LEN, pack_with_logits, ragged_padded_batch
from tests.helpers.reference import (
    make_mlm_batch,
    reference_loss,
    reference_loss_and_grad,
    token_losses,
)
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

pytestmark = pytest.mark.slow

GLOBAL_BATCH, SEQ_LEN, VOCAB = 8, 16, 12
EMPTY_ROWS = (3, 5)
# Micro-batches (as global row indices) per data-parallel rank: unequal sizes, unequal numbers
# of samples per rank (5 vs 3) and, through EMPTY_ROWS, micro-batches with no masked token.
MICRO_BATCHES = {
    1: [[[0, 1, 2], [3], [4, 5, 6, 7]]],
    2: [[[0, 1, 2], [3, 4]], [[5], [6, 7]]],
    4: [[[0, 1], [2]], [[3]], [[4], [5, 6]], [[7]]],  # rank 1: only an empty micro-batch
}
BATCH = make_mlm_batch(GLOBAL_BATCH, SEQ_LEN, VOCAB, empty_rows=EMPTY_ROWS, mask_prob=0.2, seed=7)
# (tensor-parallel size, context-parallel size) of each Megatron layout on 4 processes.
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]


def _ranks() -> tuple[int, int, int, int, int, int]:
    """(dp_rank, dp_size, tp_rank, tp_size, cp_rank, cp_size) from Megatron or plain DDP."""
    if brd.megatron_is_initialized():
        from megatron.core import parallel_state as ps

        return (
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_context_parallel_rank(),
            ps.get_context_parallel_world_size(),
        )
    return dist.get_rank(), dist.get_world_size(), 0, 1, 0, 1


def _local_view(
    tensor_sbv: torch.Tensor, rows: list[int], tp: tuple[int, int], cp: tuple[int, int]
):
    """This rank's [s/cp, rows, v/tp] slice of [s, b, v] logits (or of their gradient)."""
    (tp_rank, tp_size), (cp_rank, cp_size) = tp, cp
    shard = VOCAB // tp_size
    local = slice_for_context_parallel(tensor_sbv[:, rows], 0, cp_size, cp_rank)
    return local[..., tp_rank * shard : (tp_rank + 1) * shard]


def _check_against_single_process(validation_step: bool, **loss_kwargs) -> None:
    dp_rank, dp_size, tp_rank, tp_size, cp_rank, cp_size = _ranks()
    logits, labels, mask = BATCH
    ref_loss, ref_grad = reference_loss_and_grad(logits, labels, mask)

    reports, local_tokens = [], torch.zeros((), dtype=torch.int64)
    grads = []
    for rows in MICRO_BATCHES[dp_size][dp_rank]:
        full_batch = {"labels": labels[rows], "loss_mask": mask[rows]}
        batch = get_batch_on_this_cp_rank(full_batch)
        if cp_size > 1:
            from megatron.core.utils import get_batch_on_this_cp_rank as megatron_slicer

            expected = megatron_slicer(dict(full_batch))
            for key in full_batch:
                assert torch.equal(batch[key], expected[key]), key
        leaf = _local_view(logits, rows, (tp_rank, tp_size), (cp_rank, cp_size)).clone()
        leaf.requires_grad_(True)
        loss_fn = BERTMLMLossWithReduction(
            validation_step=validation_step, val_drop_last=False, **loss_kwargs
        )
        with forbid_host_syncs(), count_collectives() as calls:
            loss_fn.setup(batch)
            loss_sum, num_tokens, report = loss_fn({"token_logits": leaf})
            if not validation_step:
                loss_sum.backward()
        # Under TP, the cross-entropy's one all-reduce over the vocabulary shards.
        assert dict(calls) == ({} if tp_size == 1 else {"all_reduce": 1}), dict(calls)
        grads.append(leaf.grad)  # None in validation
        local_tokens += num_tokens
        reports.append(report)

    with forbid_host_syncs(), count_collectives() as calls:
        BERTMLMLossWithReduction(validation_step=validation_step).reduce(reports)
    assert calls["all_reduce"] == (1 if dp_size * cp_size > 1 else 0), calls
    reduced = checked_reduce(reports)
    torch.testing.assert_close(reduced, ref_loss, rtol=1e-13, atol=0)

    if validation_step:
        return
    # What Megatron's finalize_model_grads does with calculate_per_token_loss=True:
    # grad = d(sum of local loss sums) / global_num_tokens, counted over DP x CP.
    global_tokens = all_reduce_sum_(local_tokens.clone(), loss_reduction_group())
    assert int(global_tokens) == int(mask.sum())
    with count_collectives() as calls:  # no group: no reduction, not the default group's
        assert torch.equal(all_reduce_sum_(local_tokens.clone(), None), local_tokens)
    assert not calls
    for rows, grad in zip(MICRO_BATCHES[dp_size][dp_rank], grads, strict=True):
        expected = _local_view(ref_grad, rows, (tp_rank, tp_size), (cp_rank, cp_size))
        torch.testing.assert_close(grad / global_tokens, expected, rtol=1e-12, atol=1e-15)


def _loss_checks() -> None:
    _check_against_single_process(validation_step=False)
    _check_against_single_process(validation_step=False, capacity=0.7)
    _check_against_single_process(validation_step=True)


def _megatron_cross_entropy_checks() -> None:
    _, _, tp_rank, tp_size, _, _ = _ranks()
    logits, labels, mask = make_mlm_batch(3, 8, VOCAB, mask_prob=1.0, dtype=torch.float32)
    ref = token_losses(logits, labels, mask)
    _, ref_grad = reference_loss_and_grad(logits, labels, mask, "sum")
    cols = slice(tp_rank * VOCAB // tp_size, (tp_rank + 1) * VOCAB // tp_size)
    for fused in (False, True):
        local = logits[..., cols].clone().requires_grad_(True)
        before = local.detach().clone()
        per_token = unreduced_token_loss_fn(local, labels, cross_entropy_loss_fusion=fused)
        per_token.sum().backward()
        assert torch.equal(local.detach(), before), "caller's logits were modified"
        torch.testing.assert_close(per_token.double(), ref, rtol=1e-5, atol=1e-6)
        # The fused kernel returns its gradient in bf16, whatever the logits' dtype.
        tol = 1e-2 if fused else 1e-5
        torch.testing.assert_close(local.grad.double(), ref_grad[..., cols], rtol=tol, atol=tol)
        # The loss class runs the same kernel when asked for it by name (the fused one's bf16
        # gradient tells them apart).
        loss_fn = BERTMLMLossWithReduction(cross_entropy="megatron_fused" if fused else "megatron")
        loss_fn.setup({"labels": labels, "loss_mask": mask})
        leaf = before.clone().requires_grad_(True)
        with count_collectives() as calls:
            loss_sum, _, _ = loss_fn({"token_logits": leaf})
            loss_sum.backward()
        if not fused:  # Megatron-Core's path runs three all-reduces, even at TP = 1
            assert dict(calls) == {"all_reduce": 3}, dict(calls)
        torch.testing.assert_close(loss_sum, per_token.detach().sum(), rtol=1e-6, atol=0)
        torch.testing.assert_close(leaf.grad, local.grad, rtol=1e-6, atol=1e-7)


def _cross_entropy_loss_sum_checks(
    tp_group: dist.ProcessGroup | None, tp_rank: int, tp_size: int
) -> None:
    cols = slice(tp_rank * VOCAB // tp_size, (tp_rank + 1) * VOCAB // tp_size)
    logits, labels, mask = make_mlm_batch(3, 10, VOCAB, mask_prob=0.4, seed=3)
    weights = mask * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grad = reference_loss_and_grad(logits, labels, weights, "sum")
    for capacity in ["all", "nonzero", 0.6]:
        for in_place in (False, True):
            leaf = logits[..., cols].clone().requires_grad_(True)
            with count_collectives() as calls:
                loss_sum, _ = cross_entropy_loss_sum(
                    leaf * 1,
                    labels,
                    weights,
                    capacity=capacity,
                    in_place=in_place,
                    chunk_elements=20,
                    tp_group=tp_group,
                )
            assert dict(calls) == {"all_reduce": 1}, (capacity, dict(calls))
            loss_sum.backward()
            torch.testing.assert_close(loss_sum, ref_loss, rtol=1e-13, atol=0)
            torch.testing.assert_close(leaf.grad, ref_grad[..., cols], rtol=1e-12, atol=1e-15)


def _perplexity_checks() -> None:
    """``TokenPerplexity`` of this rank's micro-batches (its vocab shard under TP, where the
    cross-entropy's all-reduce is the only collective) synced over DP; summed over every rank
    instead, the TP ranks would count each token ``tp`` times."""
    dp_rank, dp_size, tp_rank, tp_size, _, _ = _ranks()
    logits, labels, mask = BATCH
    expected = reference_loss(logits, labels, mask).exp()
    mine = MICRO_BATCHES[dp_size][dp_rank]
    metric, over_world = TokenPerplexity(), TokenPerplexity(process_group=dist.group.WORLD)
    with count_collectives() as calls:
        for rows in mine:
            local = _local_view(logits, rows, (tp_rank, tp_size), (0, 1))
            metric.update_from_logits(local, labels[rows], mask[rows])
            over_world.update_from_logits(local, labels[rows], mask[rows])
    assert set(calls) <= ({"all_reduce"} if tp_size > 1 else set()), calls
    metrics = [(metric, 1), (over_world, tp_size)]
    if tp_size == 1:  # the metric from the sums of each micro-batch: no collective
        from_sums = TokenPerplexity()
        sums = [cross_entropy_loss_sum(logits[:, r], labels[r], mask[r]) for r in mine]
        with count_collectives() as calls:
            for loss_sum, num_tokens in sums:
                from_sums.update(loss_sum, num_tokens)
        assert not calls
        metrics.append((from_sums, 1))
    for each, copies in metrics:
        torch.testing.assert_close(each.compute(), expected, rtol=2e-6, atol=0)
        with each.sync_context():
            assert int(each.denominator) == copies * int(mask.sum())


def _packed_checks() -> None:
    from megatron.core import parallel_state as ps

    logits, batch, _ = ragged_padded_batch(weighted=True)
    packed = pack_with_logits(batch, logits, 4)
    for mode in MODES:
        ref_loss, ref_grad = reference_loss_and_grad(
            logits, batch["labels"], batch["loss_mask"], mode, **mode_kwargs(mode, RAGGED_SEQ_LEN)
        )
        token_logits = packed["logits"].transpose(0, 1).detach().requires_grad_(True)
        shard = get_packed_batch_on_this_cp_rank({**packed, "logits": token_logits.transpose(0, 1)})
        loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode, RAGGED_SEQ_LEN))
        loss_fn.setup(shard)
        numerator, denominator, report = loss_fn({"token_logits": shard["logits"].transpose(0, 1)})
        numerator.backward()
        torch.testing.assert_close(checked_reduce([report]), ref_loss, rtol=1e-13, atol=0)
        # What finalize_model_grads does: sum gradients and denominators over DP x CP.
        group = ps.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(token_logits.grad, group=group)
        dist.all_reduce(denominator, group=group)
        grad = unpack_sequences(
            token_logits.grad / denominator,
            packed["cu_seqlens"],
            RAGGED_SEQ_LEN,
            cu_seqlens_padded=packed["cu_seqlens_padded"],
            seq_dim=0,
        )
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
        if mode != "per_token":
            bare = {k: v for k, v in shard.items() if not k.startswith("sequence_")}
            loss_fn.setup(bare)
            with pytest.raises(ValueError, match="sequence_weight"):
                loss_fn({"token_logits": shard["logits"].transpose(0, 1)})


def _every_layout_body() -> None:
    _loss_checks()  # plain torch.distributed: no Megatron parallel state yet
    _cross_entropy_loss_sum_checks(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    for tp, cp in LAYOUTS:
        with megatron_parallel_state(tp, cp):
            assert _ranks()[1::2] == (4 // (tp * cp), tp, cp)
            _loss_checks()
            if cp == 1:
                _megatron_cross_entropy_checks()
                _perplexity_checks()
            if cp == 1 and tp > 1:
                _cross_entropy_loss_sum_checks(None, tp_rank=_ranks()[2], tp_size=tp)
            if (tp, cp) == (1, 2):
                _packed_checks()


def test_every_parallel_layout_matches_single_process() -> None:
    run_distributed(_every_layout_body, 4, megatron=False)
