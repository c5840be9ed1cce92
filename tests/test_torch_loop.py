"""GlobalBatchLoss in one process: modes, layouts, splits, packing vs F.cross_entropy.

Multi-process runs (DDP, FSDP2, CP = 2) are in tests/integration/test_torch_loop_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

from bert_reduce import GlobalBatchLoss
from bert_reduce.packing import pack_batch, unpack_sequences
from tests.helpers.mode_reference import MODES, float_weights, mode_kwargs, run_mode_microbatches
from tests.helpers.packed_batch import RAGGED_LENGTHS, RAGGED_SEQ_LEN, ragged_padded_batch
from tests.helpers.reference import (
    make_head_batch,
    make_mlm_batch,
    reference_loss,
    reference_loss_and_grad,
)
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

LENGTHS, SEQ_LEN = RAGGED_LENGTHS, RAGGED_SEQ_LEN


def run_steps(
    inputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    sizes: list[int],
    layout: str = "bs",
    **kwargs,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """GlobalBatchLoss over row micro-batches of ``([s, b, v] logits,)`` or, for the fused
    head, ``([s, b, h] hidden, [v, h] weight, [v] bias)``; the loss and the inputs' grads."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    micro_batches, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        micro_batches.append((rows, {"labels": labels[rows], "loss_mask": loss_mask[rows]}))
        start += size
    loss_fn = GlobalBatchLoss(group=None, layout=layout, **kwargs)
    loss_fn.begin([mb for _, mb in micro_batches])
    for rows, mb in micro_batches:
        part = leaves[0][:, rows]
        output = part.transpose(0, 1) if layout == "bs" else part
        if len(leaves) == 3:  # the layout follows layout unless the mapping says otherwise
            output = {"hidden_states": output, "output_weight": leaves[1], "output_bias": leaves[2]}
        loss_fn(output, mb).backward()
    return loss_fn.end(), [leaf.grad for leaf in leaves]


def head_inputs(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[s, b, h]`` hidden states, a ``[v, h]`` weight and a non-zero ``[v]`` bias for logits'
    ``[s, b, v]`` shape."""
    s, b, v = logits.shape
    return make_head_batch(b, s, 6, v, seed=2)[:3]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["bs", "sb"])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("sizes", [[8], [3, 0, 5], [1] * 8])
@pytest.mark.parametrize("output", ["logits", "fused head"])
def test_every_output_mode_layout_and_split_equals_reference(
    mode, layout, weights, sizes, output
) -> None:
    logits, labels, mask = make_mlm_batch(8, 10, 7, empty_rows=(0, 3, 4), mask_prob=0.3)
    loss_mask = float_weights(mask) if weights else mask
    inputs = head_inputs(logits) if output == "fused head" else (logits,)
    loss, grads = run_steps(
        inputs, labels, loss_mask, sizes, layout, normalization=mode, **mode_kwargs(mode)
    )
    refs = [t.clone().requires_grad_(True) for t in inputs]
    ref_logits = torch.nn.functional.linear(*refs) if len(refs) == 3 else refs[0]
    ref_loss = reference_loss(ref_logits, labels, loss_mask, mode, **mode_kwargs(mode))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    for grad, ref in zip(grads, refs, strict=True):
        torch.testing.assert_close(grad, ref.grad, rtol=1e-10, atol=1e-15)


def test_empty_micro_batches_and_an_empty_step_give_zero_loss_and_zero_grad() -> None:
    # GlobalBatchLoss, and BERTMLMLossWithReduction's reports and gradient as Megatron takes them.
    logits, labels, mask = make_mlm_batch(4, 6, 5, empty_rows=(0, 1, 2, 3))
    for mode in MODES:
        options = {"normalization": mode, **mode_kwargs(mode)}
        loss, (grad,) = run_steps((logits,), labels, mask, [1, 3], **options)
        megatron = run_mode_microbatches(logits, labels, mask, [1, 3], **options)
        for value in (loss, grad, *megatron):
            assert torch.equal(value, torch.zeros_like(value)), mode
    loss_fn = GlobalBatchLoss(group=None)
    assert float(loss_fn.begin([])) == 0.0
    assert float(loss_fn.end()) == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("output", ["logits", "fused head"])
def test_no_host_sync_and_no_collective_per_micro_batch(mode, output) -> None:
    logits, labels, mask = make_mlm_batch(4, 8, 9)
    hidden, weight, bias = head_inputs(logits)
    bsv = (hidden if output == "fused head" else logits).transpose(0, 1).requires_grad_(True)
    loss_fn = GlobalBatchLoss(group=None, normalization=mode, **mode_kwargs(mode))
    mbs = [{"labels": labels[:2], "loss_mask": float_weights(mask[:2])}, {"labels": labels[2:]}]
    for mb in mbs:  # the collator's host count: the kernels size their work without a sync
        mb["num_scored"] = int((mb["labels"] != -100).sum())
    with forbid_host_syncs(), count_collectives() as calls:
        loss_fn.begin(mbs)
        for rows, mb in zip((slice(0, 2), slice(2, 4)), mbs, strict=True):
            out = bsv[rows]
            if output == "fused head":
                out = {"hidden_states": out, "output_weight": weight, "output_bias": bias}
            loss_fn(out, mb).backward()
        loss_fn.end()
    assert sum(calls.values()) == 0


def test_errors_name_what_to_do() -> None:
    # Bad logits and hidden states: loss_terms' and the fused head's own tests.
    logits, labels, _ = make_mlm_batch(2, 4, 5)
    bsv = logits.transpose(0, 1)
    loss_fn = GlobalBatchLoss(group=None)
    with pytest.raises(RuntimeError, match="call begin"):
        loss_fn(bsv, {"labels": labels})
    with pytest.raises(TypeError, match="as a list"):
        loss_fn.begin(mb for mb in [{"labels": labels}])
    with pytest.raises(KeyError, match="no 'labels'"):
        loss_fn.begin([{"input_ids": labels}])
    loss_fn.begin([{"labels": labels}])
    with pytest.raises(RuntimeError, match="0 of 1 micro-batches"):
        loss_fn.end()
    with pytest.raises(ValueError, match="gradient_sync must be"):
        GlobalBatchLoss(group=None, gradient_sync="avg")  # type: ignore[arg-type]
    sequences_unknown = GlobalBatchLoss(
        group=None, normalization="per_sequence", context_parallel_size=2
    )
    with pytest.raises(ValueError, match="under context parallelism need"):
        sequences_unknown.begin([{"labels": labels}])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "keys,multiple",
    [
        ("cu_seq_lens_q", 1),
        ("position_ids", 1),
        ("cu_seq_lens_q padded", 4),
        ("position_ids loss_mask", 1),
        ("cu_seq_lens_q padded loss_mask", 4),
    ],
)
def test_hf_packed_batch_equals_unpacked_in_every_mode(mode, keys, multiple) -> None:
    weights = "loss_mask" in keys
    logits, batch, _ = ragged_padded_batch(weights)
    loss_mask = batch["loss_mask"]
    labels = torch.where(loss_mask != 0, batch["labels"], -100)
    ref_loss, ref_grad = reference_loss_and_grad(
        logits, labels, loss_mask, mode, **mode_kwargs(mode)
    )
    packed = pack_batch(
        {"labels": labels, "loss_mask": loss_mask, "logits": logits.transpose(0, 1)},
        LENGTHS,
        pad_to_multiple_of=multiple,
    )
    # The micro-batch as DataCollatorWithFlattening (and its CP-padded variant) names it.
    mb = {"labels": packed["labels"]}
    if weights:
        mb["loss_mask"] = packed["loss_mask"]
    if "cu_seq_lens_q" in keys:
        mb["cu_seq_lens_q"] = mb["cu_seq_lens_k"] = packed["cu_seqlens"]
        mb["max_length_q"] = mb["max_length_k"] = max(LENGTHS)
    if "padded" in keys:
        mb["cu_seq_lens_q_padded"] = packed["cu_seqlens_padded"]
    if "position_ids" in keys:
        bounds = packed["cu_seqlens_padded"].long()
        positions = torch.arange(packed["labels"].shape[1])
        starts = bounds[torch.searchsorted(bounds[1:], positions, right=True)]
        mb["position_ids"] = (positions - starts)[None]
    leaf = packed["logits"].detach().clone().requires_grad_(True)
    loss_fn = GlobalBatchLoss(group=None, normalization=mode, **mode_kwargs(mode))
    loss_fn.begin([mb])
    loss_fn(leaf, mb).backward()
    torch.testing.assert_close(loss_fn.end(), ref_loss, rtol=1e-12, atol=0)
    grad = unpack_sequences(
        leaf.grad, packed["cu_seqlens"], SEQ_LEN, cu_seqlens_padded=packed["cu_seqlens_padded"]
    )
    torch.testing.assert_close(grad.transpose(0, 1), ref_grad, rtol=1e-10, atol=1e-15)


def test_packed_looking_batch_without_boundaries_is_refused() -> None:
    # cu_seq_lens_k and max_length_q without cu_seq_lens_q: it looks packed, says nothing.
    mb = {"labels": torch.tensor([[1, -100, 2, 3]]), "cu_seq_lens_k": torch.tensor([0, 2, 4])}
    mb["max_length_q"] = 2
    with pytest.raises(ValueError, match=r"looks packed \(it has \['cu_seq_lens_k'"):
        GlobalBatchLoss(group=None, normalization="per_sequence").begin([mb])
    GlobalBatchLoss(group=None).begin([mb])  # per-token mode needs no boundaries


def test_default_group_is_looked_up_at_begin(tmp_path) -> None:
    import torch.distributed as dist

    loss_fn = GlobalBatchLoss()  # built before the process group exists
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        loss_fn.begin([{"labels": torch.tensor([[1, -100]])}])
        assert loss_fn.group is dist.group.WORLD
    finally:
        dist.destroy_process_group()
