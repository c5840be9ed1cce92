from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce import BERTMLMLossWithReduction, pack_batch
from bert_reduce.context_parallel import (
    get_packed_batch_on_this_cp_rank,
)
from bert_reduce.packing import unpack_sequences
from tests.helpers.dist_utils import run_distributed
from tests.helpers.mode_reference import (
    MODES,
    checked_reduce,
    reference_mode_loss,
    reference_mode_loss_and_grad,
)
from tests.helpers.mode_reference import mode_kwargs as _mode_kwargs
from tests.helpers.reference import (
    RAGGED_LENGTHS,
    RAGGED_SEQ_LEN,
    RAGGED_VOCAB,
    ragged_mlm_batch,
)
from tests.helpers.sync_guard import forbid_host_syncs

LENGTHS, SEQ_LEN, VOCAB = RAGGED_LENGTHS, RAGGED_SEQ_LEN, RAGGED_VOCAB


def mode_kwargs(mode: str) -> dict:
    return _mode_kwargs(mode, SEQ_LEN)


def padded_batch(weighted: bool = False, seed: int = 3):
    """A right-padded [b, s] batch whose loss mask is already 0 on padding, and its logits."""
    logits, labels, mask, real = ragged_mlm_batch(seed)
    loss_mask = mask
    if weighted:
        gen = torch.Generator().manual_seed(seed)
        loss_mask = torch.where(mask, torch.rand(mask.shape, generator=gen, dtype=torch.float64), 0)
    input_ids = torch.randint(1, VOCAB, (len(LENGTHS), SEQ_LEN))
    return logits, {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}, real


def pack_with_logits(batch: dict, logits_sbv: torch.Tensor, multiple: int) -> dict:
    """Pack the batch and, as a stand-in model output, the logits ([T, 1, v])."""
    packed = pack_batch(
        {**batch, "logits": logits_sbv.transpose(0, 1)}, LENGTHS, pad_to_multiple_of=multiple
    )
    # Huge logits on padding slots: if padding were ever scored, the loss would change.
    padding = torch.ones(packed["labels"].shape[1], dtype=torch.bool)
    for start, n in zip(packed["cu_seqlens_padded"][:-1].tolist(), LENGTHS, strict=True):
        padding[start : start + n] = False
    packed["logits"] = torch.where(padding[None, :, None], 1e4, packed["logits"])
    packed["padding"] = padding
    return packed


@pytest.mark.parametrize("multiple", [1, 4])
def test_pack_unpack_round_trip(multiple) -> None:
    logits, batch, real = padded_batch()
    packed = pack_batch({**batch, "attention_mask": real.long()}, pad_to_multiple_of=multiple)
    assert "attention_mask" not in packed
    padded = [-(-n // multiple) * multiple for n in LENGTHS]
    assert packed["cu_seqlens"].tolist() == [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    assert packed["cu_seqlens_padded"].tolist() == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert packed["cu_seqlens"].dtype == torch.int32
    assert packed["max_seqlen"] == max(padded)
    assert packed["labels"].shape == (1, sum(padded))
    for key, pad in (("input_ids", 0), ("labels", -100), ("loss_mask", False)):
        unpacked = unpack_sequences(
            packed[key],
            packed["cu_seqlens"],
            SEQ_LEN,
            cu_seqlens_padded=packed["cu_seqlens_padded"],
            pad_value=pad,
        )
        assert torch.equal(unpacked, torch.where(real, batch[key], pad)), key
    packed_logits = pack_batch(
        {"logits": logits.transpose(0, 1)}, LENGTHS, pad_to_multiple_of=multiple
    )["logits"].transpose(0, 1)
    unpacked = unpack_sequences(
        packed_logits,
        packed["cu_seqlens"],
        SEQ_LEN,
        cu_seqlens_padded=packed["cu_seqlens_padded"],
        seq_dim=0,
    )
    assert torch.equal(unpacked, torch.where(real.T[..., None], logits, 0))


def test_pack_errors() -> None:
    _, batch, real = padded_batch()
    with pytest.raises(ValueError, match=r"lengths must be 6 values in \[1, 12\]"):
        pack_batch(batch, [0, *LENGTHS[1:]])
    not_right_padded = real.clone()
    not_right_padded[0, 0] = False
    with pytest.raises(ValueError, match="right-padded"):
        pack_batch({**batch, "attention_mask": not_right_padded})
    with pytest.raises(ValueError, match="needs lengths"):
        pack_batch(batch)
    packed = pack_batch(batch, LENGTHS, pad_to_multiple_of=2)
    with pytest.raises(ValueError, match="multiples of 2 \\* cp_size = 4"):
        get_packed_batch_on_this_cp_rank(packed, cp_size=2, cp_rank=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_loss_and_grad_equal_unpacked_reference(mode, weighted, multiple) -> None:
    logits, batch, _ = padded_batch(weighted)
    ref_loss, ref_grad = reference_mode_loss_and_grad(
        logits, batch["labels"], batch["loss_mask"], mode, **mode_kwargs(mode)
    )
    packed = pack_with_logits(batch, logits, multiple)
    token_logits = packed["logits"].transpose(0, 1).detach().requires_grad_(True)
    loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode))
    # The packer's sequence_weight/sequence_start are dropped here, so that the loss derives
    # them from cu_seqlens_padded itself (the CP tests below use the packer's).
    loss_fn.setup({k: v for k, v in packed.items() if not k.startswith("sequence_")})
    numerator, denominator, report = loss_fn({"token_logits": token_logits})
    numerator.backward()
    torch.testing.assert_close(checked_reduce([report]), ref_loss, rtol=1e-12, atol=0)
    grad = unpack_sequences(
        token_logits.grad / denominator,
        packed["cu_seqlens"],
        SEQ_LEN,
        cu_seqlens_padded=packed["cu_seqlens_padded"],
        seq_dim=0,
    )
    torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-15)
    assert torch.equal(
        token_logits.grad[packed["padding"]], torch.zeros_like(token_logits.grad[packed["padding"]])
    )


def test_packed_batch_without_cu_seqlens_would_be_wrong() -> None:
    # Guards the test above: a packed row read as one sequence changes both modes' values.
    logits, batch, _ = padded_batch()
    packed = pack_with_logits(batch, logits, 1)
    for mode in ("per_sequence", "constant"):
        loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode))
        loss_fn.setup({"labels": packed["labels"], "loss_mask": packed["loss_mask"]})
        _, _, report = loss_fn({"token_logits": packed["logits"].transpose(0, 1)})
        ref = reference_mode_loss(
            logits, batch["labels"], batch["loss_mask"], mode, **mode_kwargs(mode)
        )
        assert not torch.isclose(checked_reduce([report]), ref)


def simulated_cp_loss_and_grad(packed: dict, mode: str, cp_size: int):
    """Every CP rank's (numerator, denominator) and logits gradient, summed as Megatron does."""
    token_logits = packed["logits"].transpose(0, 1).detach().requires_grad_(True)
    numerator = denominator = 0
    for cp_rank in range(cp_size):
        shard = get_packed_batch_on_this_cp_rank(
            {**packed, "logits": token_logits.transpose(0, 1)}, cp_size=cp_size, cp_rank=cp_rank
        )
        loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode))
        loss_fn.setup(shard)
        n, d, _ = loss_fn({"token_logits": shard["logits"].transpose(0, 1)})
        n.backward()
        numerator, denominator = numerator + n.detach(), denominator + d
    return numerator / denominator, token_logits.grad / denominator


@pytest.mark.parametrize("mode", MODES)
def test_simulated_cp2_on_packed_batch_is_exact(mode) -> None:
    logits, batch, _ = padded_batch(weighted=True)
    ref_loss, ref_grad = reference_mode_loss_and_grad(
        logits, batch["labels"], batch["loss_mask"], mode, **mode_kwargs(mode)
    )
    packed = pack_with_logits(batch, logits, 4)
    loss, grad = simulated_cp_loss_and_grad(packed, mode, cp_size=2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    grad = unpack_sequences(
        grad,
        packed["cu_seqlens"],
        SEQ_LEN,
        cu_seqlens_padded=packed["cu_seqlens_padded"],
        seq_dim=0,
    )
    torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-15)


def _cp2_packed_body() -> None:
    from megatron.core import parallel_state as ps

    assert ps.get_context_parallel_world_size() == 2
    logits, batch, _ = padded_batch(weighted=True)
    packed = pack_with_logits(batch, logits, 4)
    for mode in MODES:
        ref_loss, ref_grad = reference_mode_loss_and_grad(
            logits, batch["labels"], batch["loss_mask"], mode, **mode_kwargs(mode)
        )
        token_logits = packed["logits"].transpose(0, 1).detach().requires_grad_(True)
        shard = get_packed_batch_on_this_cp_rank({**packed, "logits": token_logits.transpose(0, 1)})
        loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode))
        loss_fn.setup(shard)
        numerator, denominator, report = loss_fn({"token_logits": shard["logits"].transpose(0, 1)})
        numerator.backward()
        # Megatron's vocab-parallel cross-entropy computes in fp32.
        torch.testing.assert_close(checked_reduce([report]), ref_loss, rtol=1e-6, atol=0)
        # What finalize_model_grads does: sum gradients and denominators over DP x CP.
        group = ps.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(token_logits.grad, group=group)
        dist.all_reduce(denominator, group=group)
        grad = unpack_sequences(
            token_logits.grad / denominator,
            packed["cu_seqlens"],
            SEQ_LEN,
            cu_seqlens_padded=packed["cu_seqlens_padded"],
            seq_dim=0,
        )
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
        if mode != "per_token":
            bare = {k: v for k, v in shard.items() if not k.startswith("sequence_")}
            loss_fn.setup(bare)
            with pytest.raises(ValueError, match="sequence_weight"):
                loss_fn({"token_logits": shard["logits"].transpose(0, 1)})


@pytest.mark.slow
def test_real_cp2_on_packed_batch_matches_unpacked_reference() -> None:
    run_distributed(_cp2_packed_body, 2, cp=2)


@pytest.mark.parametrize("mode", MODES)
def test_loss_on_packed_batch_has_no_host_sync(mode) -> None:
    logits, batch, _ = padded_batch(weighted=True)
    packed = pack_with_logits(batch, logits, 4)
    bare = {k: v for k, v in packed.items() if not k.startswith("sequence_")}
    token_logits = packed["logits"].transpose(0, 1).requires_grad_(True)
    with forbid_host_syncs():
        loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode))
        loss_fn.setup(bare)
        numerator, _, _ = loss_fn({"token_logits": token_logits})
        numerator.backward()
