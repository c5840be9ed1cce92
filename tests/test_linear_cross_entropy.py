"""The fused masked-only LM head against F.linear + F.cross_entropy on the whole unsplit batch."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from bert_reduce import (
    BERTMLMLossWithReduction,
    get_batch_on_this_cp_rank,
    linear_cross_entropy_token_losses,
)
from bert_reduce.linear_cross_entropy import linear_cross_entropy_weighted_sum
from tests.helpers.reference import linear_reference, make_head_batch
from tests.helpers.sync_guard import HostSyncError, count_collectives, forbid_host_syncs

CAPACITIES = ["all", "nonzero", 15, 0.5, 1.0]
# The per-token losses, in small chunks so that every test crosses row and vocabulary chunk
# boundaries; their weighted sum in one pass over row chunks of the whole vocabulary (default,
# and small row chunks), and in two (log-sum-exp, then gradients) when the vocabulary is
# chunked as under TP.
ENTRIES = {
    "token losses": {"chunk_rows": 4, "chunk_vocab": 5},
    "sum, one pass": {},
    "sum, one pass, 4-row chunks": {"chunk_rows": 4},
    "sum, two passes": {"chunk_rows": 4, "chunk_vocab": 5},
}
SUMS = [entry for entry in ENTRIES if entry != "token losses"]
UPSTREAM = 0.37  # the backward must scale the forward's gradients by the upstream gradient


def run_head(
    entry: str,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    mask: Tensor,
    coef: Tensor,
    **kwargs,
) -> tuple[Tensor, ...]:
    """The entry's losses (or weighted sum) and the gradients of ``sum(coef * losses)``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight)]
    bias_leaf = None if bias is None else bias.detach().clone().requires_grad_(True)
    args = (leaves[0], leaves[1], labels)
    if entry == "token losses":
        out = linear_cross_entropy_token_losses(*args, mask, bias=bias_leaf, **kwargs)
        total = (out * coef.to(out.dtype)).sum()
    else:
        out = total = linear_cross_entropy_weighted_sum(*args, coef, bias=bias_leaf, **kwargs)
    (UPSTREAM * total).backward()
    grads = [leaf.grad for leaf in leaves] + [None if bias_leaf is None else bias_leaf.grad]
    return out.detach(), *(None if g is None else g / UPSTREAM for g in grads)


def reference(
    entry: str, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
    coef: Tensor, layout: str = "sb",
) -> tuple[Tensor, ...]:  # fmt: skip
    losses, *grads = linear_reference(hidden, weight, bias, labels, coef, layout)
    return losses if entry == "token losses" else (losses * coef).sum(), *grads


def assert_matches(got: tuple[Tensor, ...], expected: tuple[Tensor, ...], rtol: float) -> None:
    for name, a, e in zip(("loss", "hidden", "weight", "bias"), got, expected, strict=True):
        if e is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a.to(torch.float64), e, rtol=rtol, atol=rtol, msg=name)


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("layout", ["sb", "bs"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("entry", ENTRIES)
def test_matches_linear_then_cross_entropy_fp64(capacity, layout, with_bias, entry) -> None:
    hidden, weight, bias, labels, mask = make_head_batch(layout=layout, empty_rows=(2,))
    assert int(mask.sum()) <= 15
    bias = bias if with_bias else None
    # Per-token coefficients make every row's gradient distinct (any normalization's shape).
    coef = mask * (torch.rand(mask.shape, dtype=torch.float64) + 0.5)
    got = run_head(
        entry, hidden, weight, bias, labels, mask, coef,
        capacity=capacity, layout=layout, **ENTRIES[entry],
    )  # fmt: skip
    assert got[0].dtype == torch.float64
    assert got[0].shape == (labels.shape if entry == "token losses" else ())
    assert_matches(got, reference(entry, hidden, weight, bias, labels, coef, layout), rtol=1e-10)
    unscored = ~mask if layout == "bs" else ~mask.t()
    assert torch.equal(got[1][unscored], torch.zeros_like(got[1][unscored]))


@pytest.mark.parametrize("chunks", [(1, 1), (3, 13), (100, 2), (None, None)])
def test_chunk_sizes_do_not_change_the_result(chunks) -> None:
    hidden, weight, bias, labels, mask = make_head_batch(v=11)
    coef = mask.double()
    got = run_head(
        "token losses", hidden, weight, bias, labels, mask, coef, capacity=0.5,
        chunk_rows=chunks[0], chunk_vocab=chunks[1],
    )  # fmt: skip
    assert_matches(got, linear_reference(hidden, weight, bias, labels, coef), rtol=1e-10)


@pytest.mark.parametrize("entry", ENTRIES)
def test_num_scored_overrides_capacity_and_an_undercount_or_overflow_is_nan(entry) -> None:
    hidden, weight, bias, labels, mask = make_head_batch(mask_prob=0.5)
    count = int(mask.sum())
    coef = mask * torch.rand(mask.shape, dtype=torch.float64)
    expected = reference(entry, hidden, weight, bias, labels, coef)
    inputs = (entry, hidden, weight, bias, labels, mask, coef)
    # A Python int (the micro-batch's total), the collator's per-row host ints, tensors and an
    # overcount (which only costs unscored rows of work): the capacity is ignored, no host
    # sync, no collective.
    per_row = tuple(mask.sum(dim=1).tolist())
    for num_scored in (count, per_row, torch.tensor(count), mask.sum(1), torch.tensor([count + 5])):
        with forbid_host_syncs(), count_collectives() as calls:
            got = run_head(*inputs, capacity=1, num_scored=num_scored, **ENTRIES[entry])
        assert sum(calls.values()) == 0
        assert_matches(got, expected, rtol=1e-10)
    # An undercount, or a capacity overflow, cannot pass silently: the loss and every gradient
    # are NaN, checked on the device; in the sum with no row computed at all, those of weight
    # and bias.
    overflows = [{"num_scored": count - 1}, {"num_scored": torch.tensor(count - 1)}]
    overflows += [{"capacity": count - 1}] + ([{"capacity": 0}] if entry in SUMS else [])
    for rows in overflows:
        with forbid_host_syncs():
            got = run_head(*inputs, **rows, **ENTRIES[entry])
        assert got[0][mask if entry == "token losses" else ...].isnan().all(), rows
        poisoned = got[1:] if rows != {"capacity": 0} else got[2:]
        assert all(value.isnan().any() for value in poisoned), rows
    # Without a count, the default counts the scored rows: the one (documented) host sync.
    with pytest.raises(HostSyncError), forbid_host_syncs():
        run_head(*inputs, **ENTRIES[entry])


@pytest.mark.parametrize("entry", ENTRIES)
def test_masked_label_outside_vocab_is_nan_unmasked_is_ignored(entry) -> None:
    hidden, weight, bias, labels, mask = make_head_batch()
    coef = mask.double()
    assert run_head(entry, hidden, weight, bias, labels, mask, coef)[0].isfinite().all()
    bad = labels.clone()
    bad[mask.nonzero()[0].unbind()] = 13
    for capacity in CAPACITIES:
        got = run_head(entry, hidden, weight, bias, bad, mask, coef, capacity=capacity)
        assert got[0].isnan().sum() == 1, capacity


def test_shape_and_argument_errors_name_what_is_wrong() -> None:
    hidden, weight, bias, labels, mask = make_head_batch()
    cases = [
        ({"hidden": hidden.transpose(0, 1)}, r"hidden of shape \(4, 9, 6\) must be \[s, b, h\]"),
        ({"layout": "bs"}, r"must be \[b, s, h\] = \[4, 9, h\]"),
        ({"layout": "bsh"}, "layout must be"),
        ({"weight": weight[:, :5]}, r"weight of shape \(13, 5\) must be \[v, h\] with h = 6"),
        ({"bias": bias[:4]}, r"bias of shape \(4,\) must be \[v\] = \[13\]"),
        ({"mask": mask[:, :4]}, r"loss_mask of shape \(4, 4\)"),
        ({"weight": weight.float()}, "must share one dtype"),
        ({"chunk_rows": 0}, "chunk_rows and chunk_vocab must be positive"),
        ({"sequence_parallel": True, "layout": "bs"}, "sequence_parallel=True needs"),
        ({"labels": labels.double()}, "labels must be integer token ids"),
        ({"weight": weight.to("meta")}, "hidden is on cpu and weight on meta"),
        ({"bias": bias.to("meta")}, "weight is on cpu and bias on meta"),
        ({"mask": mask.to("meta")}, "loss_mask is on meta and labels on cpu"),
    ]
    for overrides, match in cases:
        args = {"hidden": hidden, "weight": weight, "labels": labels, "mask": mask, "bias": bias}
        args.update(overrides)
        positional = [args.pop(name) for name in ("hidden", "weight", "labels", "mask")]
        with pytest.raises(ValueError, match=match):
            linear_cross_entropy_token_losses(*positional, **args)
    for bad, error in [(1.5, TypeError), (True, TypeError), (mask.sum(1).double(), TypeError),
                       (-1, ValueError)]:  # fmt: skip
        with pytest.raises(error, match="num_scored"):
            linear_cross_entropy_token_losses(hidden, weight, labels, mask, num_scored=bad)
    for weights, kwargs, match in [
        (mask, {}, "token_weights must be floating-point"),
        (mask[:, :4].double(), {}, r"token_weights of shape \(4, 4\)"),
        (mask.double(), {"chunk_rows": 0}, "chunk_rows and chunk_vocab must be positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            linear_cross_entropy_weighted_sum(hidden, weight, labels, weights, **kwargs)


def test_context_parallel_shards_with_the_whole_count_sum_to_the_reference() -> None:
    b, s = 3, 8
    hidden, weight, bias, labels, mask = make_head_batch(b, s, mask_prob=0.4)
    batch = {"labels": labels, "loss_mask": mask, "num_scored": mask.sum(dim=1)}
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    total = torch.zeros((), dtype=torch.float64)
    for cp_rank in range(2):
        shard = get_batch_on_this_cp_rank(
            {**batch, "hidden": leaves[0]},
            cp_size=2,
            cp_rank=cp_rank,
            seq_dims={"num_scored": None, "hidden": 0},
        )
        with forbid_host_syncs():
            losses = linear_cross_entropy_token_losses(
                shard["hidden"], leaves[1], shard["labels"], shard["loss_mask"],
                bias=leaves[2], num_scored=batch["num_scored"],
            )  # fmt: skip
        assert not losses.isnan().any()
        total = total + losses.sum()
    total.backward()
    expected = linear_reference(hidden, weight, bias, labels, mask.double())
    torch.testing.assert_close(total, expected[0].sum(), rtol=1e-10, atol=0)
    for leaf, grad in zip(leaves, expected[1:], strict=True):
        torch.testing.assert_close(leaf.grad, grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8])
def test_any_integer_label_dtype(dtype) -> None:
    hidden, weight, bias, labels, mask = make_head_batch()
    expected = linear_cross_entropy_token_losses(hidden, weight, labels, mask, bias=bias)
    narrow = torch.where(mask, labels, 0).to(dtype)
    got = linear_cross_entropy_token_losses(hidden, weight, narrow, mask, bias=bias)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class LogitRows(TorchDispatchMode):
    """Counts the logits the head computes: the elements of products by ``weight^T``."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.storage, self.rows = weight.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            right = args[-1]
            if right.untyped_storage().data_ptr() == self.storage and right.stride(0) == 1:
                self.rows.append(out.numel())
        return out


@pytest.mark.parametrize("entry", ["losses", "weighted sum", "loss class"])
@pytest.mark.parametrize("capacity", [None, "all"])
def test_without_a_count_only_the_scored_rows_are_computed(entry, capacity) -> None:
    b, s, v = 4, 30, 13
    hidden, weight, bias, labels, mask = make_head_batch(b, s, v=v, mask_prob=0.15)
    kwargs = {} if capacity is None else {"capacity": capacity}
    with LogitRows(weight) as counter:
        if entry == "losses":
            linear_cross_entropy_token_losses(hidden, weight, labels, mask, bias=bias, **kwargs)
        elif entry == "weighted sum":
            linear_cross_entropy_weighted_sum(
                hidden, weight, labels, mask.double(), bias=bias, **kwargs
            )
        else:
            loss_fn = BERTMLMLossWithReduction(**kwargs)
            loss_fn.setup({"labels": labels, "loss_mask": mask})
            loss_fn({"hidden_states": hidden, "output_weight": weight, "output_bias": bias})
    expected = int(mask.sum()) if capacity is None else b * s
    assert 0 < int(mask.sum()) < b * s // 4
    assert sum(counter.rows) == expected * v


@pytest.mark.parametrize("capacity", ["nonzero", "all", 4])
def test_an_empty_mask_gives_zero_loss_and_gradients(capacity) -> None:
    hidden, weight, bias, labels, mask = make_head_batch(3, 5, empty_rows=(0, 1, 2))
    for num_scored, entry in itertools.product(
        (None, 0, torch.zeros(3, dtype=torch.int64)), ENTRIES
    ):
        kwargs = {"capacity": capacity, "num_scored": num_scored, **ENTRIES[entry]}
        for value in run_head(entry, hidden, weight, bias, labels, mask, mask.double(), **kwargs):
            assert torch.equal(value, torch.zeros_like(value)), (num_scored, entry)


def test_weighted_loss_sum_computes_only_the_gradients_asked_for() -> None:
    hidden, weight, bias, labels, mask = make_head_batch(mask_prob=0.5)
    coef = mask.double()
    expected = reference(SUMS[0], hidden, weight, bias, labels, coef)
    for passes in (ENTRIES[entry] for entry in SUMS):
        # Validation: no gradient at all, only the sum.
        with torch.no_grad(), LogitRows(weight) as counter:
            total = linear_cross_entropy_weighted_sum(
                hidden, weight, labels, coef, bias=bias, **passes
            )
        torch.testing.assert_close(total, expected[0], rtol=1e-10, atol=0)
        assert sum(counter.rows) == int(mask.sum()) * 13  # one pass over the rows, not two
        # A frozen weight and bias: the hidden states' gradient alone.
        leaf = hidden.clone().requires_grad_(True)
        linear_cross_entropy_weighted_sum(
            leaf, weight, labels, coef, bias=bias, **passes
        ).backward()
        torch.testing.assert_close(leaf.grad, expected[1], rtol=1e-10, atol=1e-12)


def test_weighted_loss_sum_backward_twice_is_refused() -> None:
    hidden, weight, bias, labels, mask = make_head_batch()
    leaf = weight.clone().requires_grad_(True)
    total = linear_cross_entropy_weighted_sum(hidden, leaf, labels, mask.double(), bias=bias)
    total.backward(retain_graph=True)
    # The first backward scaled the stored gradients in place; a second cannot reuse them.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("entry", ENTRIES)
def test_half_precision_accumulates_in_fp32(dtype, entry) -> None:
    hidden, weight, bias, labels, mask = make_head_batch(4, 32, 16, 40, mask_prob=0.5)
    hidden, weight, bias = (t.to(dtype) for t in (hidden, weight, bias))
    coef = mask * torch.rand(mask.shape, dtype=torch.float64)
    # The reference runs in fp64 on the same (rounded) inputs: the fused head's logits and
    # gradient chunks are rounded to the input dtype once each, as F.linear's would be.
    got = run_head(entry, hidden, weight, bias, labels, mask, coef, capacity=0.6, **ENTRIES[entry])
    expected = reference(entry, hidden, weight, bias, labels, coef)
    assert got[0].dtype == torch.float32 and all(g.dtype == dtype for g in got[1:])
    rtol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got[0].double(), expected[0], rtol=rtol, atol=rtol)
    for a, e in zip(got[1:], expected[1:], strict=True):
        scale = e.abs().max()
        torch.testing.assert_close(a.double() / scale, e / scale, rtol=0, atol=rtol)


def test_half_precision_weight_gradient_is_summed_in_fp32_over_row_chunks() -> None:
    # 460 one-row chunks: each chunk's product is rounded to bf16 once (as F.linear's backward
    # rounds its one product), their sum keeps 16 significant bits; summed in bf16 the
    # error is ~4x larger (1.3e-2 here against 3.4e-3).
    hidden, weight, _, labels, mask = make_head_batch(8, 64, 16, 40, mask_prob=0.9)
    hidden, weight = hidden.bfloat16(), weight.bfloat16().requires_grad_(True)
    linear_cross_entropy_weighted_sum(hidden, weight, labels, mask.float(), chunk_rows=1).backward()
    expected = linear_reference(hidden, weight, None, labels, mask.double())[2]
    error = (weight.grad.double() - expected).abs().max() / expected.abs().max()
    assert error < 6e-3
