"""Megatron-Core's own schedule drives BERTMLMLossWithReduction: one step, several splits.

``forward_backward_no_pipelining`` runs the micro-batches, back-propagates what the loss
returns and hands the summed token count to the real ``finalize_model_grads``, which
all-reduces it over data x context ranks and scales the gradients by ``1 / count``
(CPU stand-ins: tests/helpers/megatron_cpu.py). The model is fp64, but
``finalize_model_grads`` computes ``1.0 / num_tokens`` from an int32 tensor, i.e. in fp32 (and
Megatron's vocab-parallel cross-entropy, when used, computes in fp32). So:

* grads of different splits agree to fp64 round-off (same per-token values, same scale);
* against ``F.cross_entropy`` in fp64 on the whole batch they agree to fp32 precision.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from bert_reduce import BERTMLMLossWithReduction
from tests.helpers.dist_utils import megatron_parallel_state, run_distributed
from tests.helpers.megatron_cpu import GradSyncShell, megatron_on_cpu, single_process_megatron
from tests.helpers.mode_reference import checked_reduce, float_weights
from tests.helpers.reference import assert_close_by_name, reference_loss

GLOBAL_BATCH, SEQ_LEN, VOCAB, HIDDEN = 8, 10, 11, 6
EMPTY_ROWS = (2, 3, 6)  # the 4 x 2 split has an empty micro-batch, 8 x 1 has three
SPLITS = [(1, 8), (2, 4), (4, 2), (8, 1)]  # (number of micro-batches, micro-batch size)
SPLIT_TOL = {"rtol": 1e-12, "atol": 1e-15}
FP32_TOL = {"rtol": 1e-5, "atol": 1e-8}


class TinyMLM(nn.Module):
    """Embedding, tanh, linear head: ``[b, s]`` ids to ``[s, b, v]`` token logits, fp64."""

    def __init__(self, calculate_per_token_loss: bool = True) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.enums import ModelType
        from megatron.core.transformer import TransformerConfig

        super().__init__()
        self.config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=1,
            params_dtype=torch.float64,
            calculate_per_token_loss=calculate_per_token_loss,
            finalize_model_grads_func=finalize_model_grads,
        )
        self.model_type = ModelType.encoder_or_decoder
        gen = torch.Generator().manual_seed(11)
        self.embedding = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.head = nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64))

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's hook for pipeline stages; a single stage reads the data iterator."""

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.embedding(input_ids))
        return {"token_logits": self.head(hidden).transpose(0, 1).contiguous()}


def global_batch(weighted: bool = False, seq_len: int = SEQ_LEN) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq_len), generator=gen)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq_len), generator=gen)
    mask = torch.rand(GLOBAL_BATCH, seq_len, generator=gen) < torch.linspace(0.1, 0.6, 8)[:, None]
    mask[list(EMPTY_ROWS)] = False
    return {
        "input_ids": input_ids,
        "labels": torch.where(mask, labels, -100),
        "loss_mask": float_weights(mask, dyadic=True) if weighted else mask,
    }


def schedule_step(
    rows: list[int], micro_batch_size: int, calculate_per_token_loss: bool = True, **loss_kwargs
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list]:
    """:func:`run_schedule` over ``rows`` of the global batch on this rank."""
    batch = global_batch(loss_kwargs.pop("weighted", False))
    micro_batches = [
        {key: value[rows[i : i + micro_batch_size]] for key, value in batch.items()}
        for i in range(0, len(rows), micro_batch_size)
    ]

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        loss_fn = BERTMLMLossWithReduction(**loss_kwargs)
        loss_fn.setup(micro_batch)
        return model(micro_batch["input_ids"]), loss_fn

    return run_schedule(forward_step, micro_batches, calculate_per_token_loss)


def run_schedule(forward_step, micro_batches, calculate_per_token_loss: bool = True) -> tuple:
    """``forward_backward_no_pipelining``: the gradients, ``reduce``'s loss and the reports."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    model = GradSyncShell(TinyMLM(calculate_per_token_loss))
    with megatron_on_cpu():
        reports = forward_backward_no_pipelining(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=SEQ_LEN,  # both unused without pipelining
            micro_batch_size=1,
        )
    grads = {name: param.grad.clone() for name, param in model.module.named_parameters()}
    return grads, checked_reduce(reports), reports


def reference_grads(
    per_micro_batch_rows: list[list[int]] | None = None,
    weighted: bool = False,
    seq_len: int = SEQ_LEN,
):
    """F.cross_entropy in fp64 on the whole batch (or the mean of per-micro-batch means)."""
    model = TinyMLM()
    batch = global_batch(weighted, seq_len)

    def mean_loss(rows: list[int]) -> torch.Tensor:
        logits = model(batch["input_ids"][rows])["token_logits"]
        return reference_loss(logits, batch["labels"][rows], batch["loss_mask"][rows], "per_token")

    if per_micro_batch_rows is None:
        loss = mean_loss(list(range(GLOBAL_BATCH)))
    else:
        loss = torch.stack([mean_loss(rows) for rows in per_micro_batch_rows]).mean()
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}, loss.detach()


@pytest.fixture
def megatron_one_rank() -> Iterator[None]:
    with single_process_megatron():
        yield


def every_split(ref: dict | None = None, **kwargs) -> list[tuple]:
    """:func:`schedule_step` under each of ``SPLITS``: the same gradients, and ``ref``'s."""
    by_split = [schedule_step(list(range(GLOBAL_BATCH)), size, **kwargs) for _, size in SPLITS]
    for grads, _, _ in by_split:
        assert_close_by_name(grads, by_split[0][0], **SPLIT_TOL)
        if ref is not None:
            assert_close_by_name(grads, ref, **FP32_TOL)
    return by_split


def test_every_split_gives_the_same_gradients_as_cross_entropy(megatron_one_rank) -> None:
    ref, ref_loss = reference_grads()
    for (num_micro_batches, size), (_, loss, reports) in zip(SPLITS, every_split(ref), strict=True):
        assert len(reports) == num_micro_batches
        counts = [int(r["loss_sum_and_microbatch_size"][1]) for r in reports]
        if size == 2:
            assert counts[1] == 0 and len(set(counts)) > 2, counts
        torch.testing.assert_close(loss, ref_loss, **FP32_TOL)


def test_calculate_per_token_loss_false_gives_the_mean_of_micro_batch_means(
    megatron_one_rank,
) -> None:
    rows = [[0, 1], [2, 3], [4, 5], [6, 7]]
    grads, _, _ = schedule_step(list(range(GLOBAL_BATCH)), 2, calculate_per_token_loss=False)
    mean_of_means, _ = reference_grads(rows)
    assert_close_by_name(grads, mean_of_means, **FP32_TOL)
    global_mean, _ = reference_grads()
    assert not torch.allclose(grads["head.weight"], global_mean["head.weight"], rtol=1e-2)


def test_other_modes_and_float_weights_through_the_schedule(megatron_one_rank) -> None:
    # Float weights: Megatron's int32 counter rejects a float denominator ...
    with pytest.raises(RuntimeError, match="can't be cast"):
        schedule_step(list(range(GLOBAL_BATCH)), 4, weighted=True)
    # ... and weight_resolution makes it an exact integer (these weights are multiples of 1/4).
    ref, _ = reference_grads(weighted=True)
    every_split(ref, weighted=True, weight_resolution=256)
    for mode, kwargs in (("per_sequence", {}), ("constant", {"constant_per_sequence": SEQ_LEN})):
        grads = every_split(normalization=mode, **kwargs)[0][0]
    # The modes differ from per_token, so the equalities above are not about per_token.
    assert not torch.allclose(grads["head.weight"], ref["head.weight"], rtol=1e-3)


def _dp2_body(
    expected: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], ref_loss: torch.Tensor
) -> None:
    from megatron.core import parallel_state

    assert parallel_state.get_data_parallel_world_size() == 2
    rank = parallel_state.get_data_parallel_rank()
    # Rank 0 holds rows 0-4 as 5 x 1 (rows 2 and 3 empty), rank 1 rows 5-7 as 1 x 3.
    rows, size = ([0, 1, 2, 3, 4], 1) if rank == 0 else ([5, 6, 7], 3)
    grads, loss, _ = schedule_step(rows, size)
    assert_close_by_name(grads, expected, **SPLIT_TOL)
    assert_close_by_name(grads, ref, **FP32_TOL)
    # reduce() all-reduces the reports over both ranks: the global mean, not rank-local.
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)


CP_SEQ_LEN = 12  # a multiple of 2 * cp_size


def _cp2_body(ref: dict[str, torch.Tensor], ref_loss: torch.Tensor) -> None:
    """docs/megatron.md's forward_step under CP = 2: each micro-batch's loss gets an int count."""
    from torch.utils.data import DataLoader, default_collate

    from bert_reduce import get_batch_on_this_cp_rank
    from bert_reduce.num_scored import NumScoredCollator

    device = torch.device("cpu")  # "cuda" on a GPU
    seen = []

    def forward_step(data_iterator, model):  # as in docs/megatron.md
        batch = get_batch_on_this_cp_rank(next(data_iterator))  # on the host, then move
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in batch.items()}  # fmt: skip
        seen.append((batch["num_scored"], batch["loss_mask"]))
        loss_fn = BERTMLMLossWithReduction()
        loss_fn.setup(batch)
        return model(batch["input_ids"]), loss_fn

    collate = NumScoredCollator(default_collate)
    batch = global_batch(seq_len=CP_SEQ_LEN)
    samples = [{key: value[i] for key, value in batch.items()} for i in range(GLOBAL_BATCH)]
    loader = DataLoader(samples, batch_size=2, collate_fn=collate)
    grads, loss, _ = run_schedule(forward_step, list(loader))
    assert len(seen) == 4
    for count, mask in seen:
        assert type(count) is int and count == int(mask.sum()), (count, mask)
    assert_close_by_name(grads, ref, **FP32_TOL)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)


def _two_ranks_body(dp_references: tuple, cp_references: tuple) -> None:
    for cp, body, references in ((1, _dp2_body, dp_references), (2, _cp2_body, cp_references)):
        with megatron_parallel_state(cp=cp):
            body(*references)


@pytest.mark.slow
def test_two_ranks_data_or_context_parallel_equal_one_rank() -> None:
    """DP = 2, then CP = 2 through docs/megatron.md's forward_step: the count survives
    Megatron's data path (collator, CP slicing, the move to the device)."""
    with single_process_megatron():
        expected, _, _ = schedule_step(list(range(GLOBAL_BATCH)), 4)
    dp_references = (expected, *reference_grads())
    cp_references = reference_grads(seq_len=CP_SEQ_LEN)
    run_distributed(_two_ranks_body, 2, dp_references, cp_references, megatron=False)
