"""Property-based: any global batch, any split, every mode gives the unsplit batch's loss.

Hypothesis draws a global batch (lengths, masks with empty rows, sometimes float weights) and
a split: rows over up to 4 data-parallel ranks, each rank's rows into micro-batches of random
sizes, context parallelism 1 or 2, packed (THD) or padded rows. Ranks and CP shards are
simulated in one process with bert_reduce's own packer and slicers, summing every shard's
(numerator, denominator) as Megatron's schedule and ``finalize_model_grads`` do; real
processes are exercised in test_packing, test_megatron_schedule and the distributed tests.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bert_reduce import BERTMLMLossWithReduction, get_batch_on_this_cp_rank, pack_batch
from bert_reduce.context_parallel import get_packed_batch_on_this_cp_rank
from bert_reduce.normalization import sequence_normalizers
from tests.helpers.mode_reference import MODES, float_weights, mode_kwargs
from tests.helpers.reference import make_mlm_batch, reference_loss_and_grad

# 60 random batches, each under a random split: seconds; the module runs in CI, outside the
# fast set.
pytestmark = pytest.mark.slow

VOCAB = 7


@st.composite
def global_batches(draw):
    batch_size = draw(st.integers(1, 8))
    seq_len = draw(st.sampled_from([4, 8, 12]))
    lengths = draw(st.lists(st.integers(1, seq_len), min_size=batch_size, max_size=batch_size))
    seed = draw(st.integers(0, 2**16))
    mask_prob = draw(st.sampled_from([0.0, 0.15, 0.5, 1.0]))
    empty_rows = draw(st.sets(st.integers(0, batch_size - 1)))
    weighted = draw(st.booleans())
    logits, labels, mask = make_mlm_batch(
        batch_size, seq_len, VOCAB, mask_prob=mask_prob, empty_rows=tuple(empty_rows), seed=seed
    )
    mask &= torch.arange(seq_len) < torch.tensor(lengths)[:, None]
    loss_mask = float_weights(mask, seed) if weighted else mask
    return logits, torch.where(mask, labels, -100), loss_mask, lengths


@st.composite
def splits(draw, batch_size: int):
    """Rows per data-parallel rank (contiguous, possibly none), then micro-batch sizes."""
    dp_size = draw(st.integers(1, 4))
    cuts = sorted(
        draw(st.lists(st.integers(0, batch_size), min_size=dp_size - 1, max_size=dp_size - 1))
    )
    bounds = [0, *cuts, batch_size]
    ranks = []
    for start, end in itertools.pairwise(bounds):
        sizes, left = [], end - start
        while left:
            sizes.append(draw(st.integers(1, left)))
            left -= sizes[-1]
        ranks.append((start, sizes))
    return ranks


def micro_batch_terms(batch: dict, mode: str, cp_size: int, packed: bool, lengths, kwargs):
    """(numerator, denominator) summed over this micro-batch's CP shards; grads accumulate."""
    if packed:
        full = pack_batch(batch, lengths, pad_to_multiple_of=2 * cp_size)
        shards = [get_packed_batch_on_this_cp_rank(full, cp_size, r) for r in range(cp_size)]
    else:
        weight, start = sequence_normalizers(batch["loss_mask"])
        full = {**batch, "sequence_weight": weight, "sequence_start": start}
        shards = [get_batch_on_this_cp_rank(full, cp_size, r) for r in range(cp_size)]
    numerator, report_sum, denominator = 0, 0, 0
    for shard in shards:
        loss_fn = BERTMLMLossWithReduction(normalization=mode, **kwargs)
        loss_fn.setup(shard)
        n, d, report = loss_fn({"token_logits": shard["logits"].transpose(0, 1)})
        numerator = numerator + n
        report_sum = report_sum + report["loss_sum_and_microbatch_size"]
        denominator = denominator + d
    # One backward per micro-batch: the shards share the packing graph.
    numerator.backward()
    return report_sum, denominator


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    batch=global_batches(),
    mode=st.sampled_from(MODES),
    cp_size=st.sampled_from([1, 2]),
    packed=st.booleans(),
)
def test_any_split_equals_the_unsplit_batch(data, batch, mode, cp_size, packed) -> None:
    logits, labels, loss_mask, lengths = batch
    kwargs = mode_kwargs(mode, constant_per_sequence=labels.shape[1])
    ref_loss, ref_grad = reference_loss_and_grad(logits, labels, loss_mask, mode, **kwargs)

    leaf = logits.detach().clone().requires_grad_(True)
    logits_bsv = leaf.transpose(0, 1)
    total = torch.zeros(2, dtype=torch.float64)
    denominator = 0
    for start, sizes in data.draw(splits(labels.shape[0]), label="split"):
        for size in sizes:
            rows = slice(start, start + size)
            start += size
            micro = {
                "labels": labels[rows],
                "loss_mask": loss_mask[rows],
                "logits": logits_bsv[rows],
            }
            report, d = micro_batch_terms(micro, mode, cp_size, packed, lengths[rows], kwargs)
            total, denominator = total + report, denominator + d

    loss = total[0] / total[1] if total[1] != 0 else total[0] * 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-14)
    grad = leaf.grad / denominator if denominator != 0 else leaf.grad
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-13)
