"""A packed (THD) batch on 2 real context-parallel ranks against the unpacked reference.

Each rank takes its load-balanced share of every packed sequence; the reduced loss and the
gradient, summed over DP x CP as finalize_model_grads does, equal the normalization mode's
definition on the whole padded batch, in every mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.context_parallel import get_packed_batch_on_this_cp_rank
from bert_reduce.packing import unpack_sequences
from tests.helpers.dist_utils import run_distributed
from tests.helpers.mode_reference import MODES, checked_reduce, mode_kwargs
from tests.helpers.packed_batch import pack_with_logits, ragged_padded_batch
from tests.helpers.reference import RAGGED_SEQ_LEN, reference_loss_and_grad

pytestmark = pytest.mark.slow


def _cp2_packed_body() -> None:
    from megatron.core import parallel_state as ps

    assert ps.get_context_parallel_world_size() == 2
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
        # Megatron's vocab-parallel cross-entropy computes in fp32.
        torch.testing.assert_close(checked_reduce([report]), ref_loss, rtol=1e-6, atol=0)
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
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
        if mode != "per_token":
            bare = {k: v for k, v in shard.items() if not k.startswith("sequence_")}
            loss_fn.setup(bare)
            with pytest.raises(ValueError, match="sequence_weight"):
                loss_fn({"token_logits": shard["logits"].transpose(0, 1)})


def test_real_cp2_on_packed_batch_matches_unpacked_reference() -> None:
    run_distributed(_cp2_packed_body, 2, cp=2)
