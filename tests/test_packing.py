from __future__ import annotations

import pytest
import torch

from bert_reduce import BERTMLMLossWithReduction, pack_batch
from bert_reduce.context_parallel import (
    get_packed_batch_on_this_cp_rank,
)
from bert_reduce.packing import unpack_sequences
from tests.helpers.mode_reference import MODES, checked_reduce, mode_kwargs
from tests.helpers.packed_batch import (
    RAGGED_LENGTHS,
    RAGGED_SEQ_LEN,
    RAGGED_VOCAB,
    pack_with_logits,
    ragged_padded_batch,
)
from tests.helpers.reference import reference_loss, reference_loss_and_grad
from tests.helpers.sync_guard import forbid_host_syncs

LENGTHS, SEQ_LEN, VOCAB = RAGGED_LENGTHS, RAGGED_SEQ_LEN, RAGGED_VOCAB


def unpack(tensor: torch.Tensor, packed: dict, **kwargs) -> torch.Tensor:
    """``tensor`` of the packed batch back to ``[b, SEQ_LEN, ...]`` (or ``[SEQ_LEN, b, ...]``)."""
    bounds = {"cu_seqlens_padded": packed["cu_seqlens_padded"]}
    return unpack_sequences(tensor, packed["cu_seqlens"], SEQ_LEN, **bounds, **kwargs)


@pytest.mark.parametrize("multiple", [1, 4])
def test_pack_unpack_round_trip(multiple) -> None:
    logits, batch, real = ragged_padded_batch()
    packed = pack_batch({**batch, "attention_mask": real.long()}, pad_to_multiple_of=multiple)
    assert "attention_mask" not in packed
    padded = [-(-n // multiple) * multiple for n in LENGTHS]
    assert packed["cu_seqlens"].tolist() == [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    assert packed["cu_seqlens_padded"].tolist() == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert packed["cu_seqlens"].dtype == torch.int32
    assert packed["max_seqlen"] == max(padded)
    assert packed["labels"].shape == (1, sum(padded))
    for key, pad in (("input_ids", 0), ("labels", -100), ("loss_mask", False)):
        unpacked = unpack(packed[key], packed, pad_value=pad)
        assert torch.equal(unpacked, torch.where(real, batch[key], pad)), key
    packed_logits = pack_batch(
        {"logits": logits.transpose(0, 1)}, LENGTHS, pad_to_multiple_of=multiple
    )["logits"].transpose(0, 1)
    unpacked = unpack(packed_logits, packed, seq_dim=0)
    assert torch.equal(unpacked, torch.where(real.T[..., None], logits, 0))


def test_pack_errors() -> None:
    _, batch, real = ragged_padded_batch()
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
    logits, batch, _ = ragged_padded_batch(weighted)
    ref_loss, ref_grad = reference_loss_and_grad(
        logits, batch["labels"], batch["loss_mask"], mode, **mode_kwargs(mode)
    )
    packed = pack_with_logits(batch, logits, multiple)
    token_logits = packed["logits"].transpose(0, 1).detach().requires_grad_(True)
    loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode))
    # The packer's sequence_weight/sequence_start are dropped here, so that the loss derives
    # them from cu_seqlens_padded itself, with no host sync (CP shards use the packer's:
    # tests/integration/test_reduction_distributed.py, and simulated, test_properties.py).
    with forbid_host_syncs():
        loss_fn.setup({k: v for k, v in packed.items() if not k.startswith("sequence_")})
        numerator, denominator, report = loss_fn({"token_logits": token_logits})
        numerator.backward()
    torch.testing.assert_close(checked_reduce([report]), ref_loss, rtol=1e-12, atol=0)
    grad = unpack(token_logits.grad / denominator, packed, seq_dim=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-15)
    assert torch.equal(
        token_logits.grad[packed["padding"]], torch.zeros_like(token_logits.grad[packed["padding"]])
    )


def test_packed_batch_without_cu_seqlens_would_be_wrong() -> None:
    # Guards the test above: a packed row read as one sequence changes both modes' values.
    logits, batch, _ = ragged_padded_batch()
    packed = pack_with_logits(batch, logits, 1)
    for mode in ("per_sequence", "constant"):
        loss_fn = BERTMLMLossWithReduction(normalization=mode, **mode_kwargs(mode))
        loss_fn.setup({"labels": packed["labels"], "loss_mask": packed["loss_mask"]})
        _, _, report = loss_fn({"token_logits": packed["logits"].transpose(0, 1)})
        ref = reference_loss(logits, batch["labels"], batch["loss_mask"], mode, **mode_kwargs(mode))
        assert not torch.isclose(checked_reduce([report]), ref)
