"""GlobalBatchLoss in real gloo processes under DDP and FSDP2 (``fully_shard``), vs one process."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from bert_reduce import GlobalBatchLoss, get_batch_on_this_cp_rank, pack_batch
from bert_reduce.context_parallel import get_packed_batch_on_this_cp_rank
from bert_reduce.normalization import sequence_normalizers
from tests.helpers.dist_utils import full_grads, run_distributed, sync_on_last
from tests.helpers.mode_reference import float_weights, mode_kwargs
from tests.helpers.packed_batch import RAGGED_LENGTHS, ragged_padded_batch
from tests.helpers.reference import reference_loss, reference_loss_and_grad
from tests.helpers.sync_guard import count_collectives

pytestmark = pytest.mark.slow

SEQ_LEN, VOCAB = 10, 11
MODES = [("per_token", False), ("per_token", True), ("per_sequence", True), ("constant", False)]
# Rows of each micro-batch, per rank, with unequal sizes; rows in EMPTY_ROWS score nothing (a
# whole micro-batch, and on 4 ranks a whole rank). DDP runs any number of micro-batches per
# rank (1 to 4 here). FSDP2 all-gathers the parameters in every forward, so its ranks must run
# the same number of micro-batches (4 each on 2 ranks, 2 each on 4 ranks).
LAYOUTS = {
    ("ddp", 2): [[[0, 1, 2], [3], [4, 5]], [[6, 7, 8, 9]]],
    ("ddp", 4): [[[0]], [[1, 2], [3, 4]], [[5], [6], [7, 8], [9]], [[10, 11, 12]]],
    ("fsdp2", 2): [[[0, 1, 2], [3], [4, 5], [6]], [[7], [8, 9], [10], [11, 12]]],
    ("fsdp2", 4): [[[0], [1, 2]], [[3, 4], [5]], [[6], [7, 8, 9]], [[10, 11], [12]]],
}
EMPTY_ROWS = {2: (4,), 4: (10, 11, 12)}


class TinyLM(nn.Module):
    """Token ids ``[b, s]`` to logits ``[b, s, v]``, as a Hugging Face model's ``.logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(input_ids))))


def global_batch(num_rows: int, empty_rows: tuple[int, ...], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (num_rows, SEQ_LEN), generator=gen)
    labels = torch.randint(0, VOCAB, (num_rows, SEQ_LEN), generator=gen)
    mask = torch.rand(num_rows, SEQ_LEN, generator=gen) < 0.35
    mask[list(empty_rows)] = False
    return input_ids, torch.where(mask, labels, -100), mask, float_weights(mask)


def wrap(model: nn.Module, wrapper: str, gradient_sync: str) -> nn.Module:
    if wrapper == "ddp":
        ddp = DistributedDataParallel(model)
        if gradient_sync == "sum":
            ddp.register_comm_hook(None, _sum_hook)
        return ddp
    fully_shard(model.mid)
    fully_shard(model)
    if gradient_sync == "sum":
        # Each fully_shard'ed module keeps its own factor: set it on every one.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
    return model


def _sum_hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _train_step_body(wrapper: str) -> None:
    # TinyLM's Linear layers return views of their matmul; nothing here writes to them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_default_dtype(torch.float64)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = LAYOUTS[wrapper, world]
    num_rows = sum(len(mb) for rank_mbs in layout for mb in rank_mbs)
    input_ids, labels, mask, weights = global_batch(num_rows, EMPTY_ROWS[world])
    torch.manual_seed(0)
    base = TinyLM()
    worst = 0.0
    for (mode, weighted), gradient_sync in [(m, g) for m in MODES for g in ("mean", "sum")]:
        loss_mask = weights if weighted else mask
        reference = copy.deepcopy(base)
        logits = reference(input_ids).transpose(0, 1)
        ref_loss = reference_loss(logits, labels, loss_mask, mode, **mode_kwargs(mode))
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        model = wrap(copy.deepcopy(base), wrapper, gradient_sync)
        micro_batches = [
            {"input_ids": input_ids[rows], "labels": labels[rows], "loss_mask": loss_mask[rows]}
            for rows in layout[rank]
        ]
        loss_fn = GlobalBatchLoss(
            normalization=mode, gradient_sync=gradient_sync, **mode_kwargs(mode)
        )
        with count_collectives() as begin_calls:
            loss_fn.begin(micro_batches)
        for index, mb in enumerate(micro_batches):
            with sync_on_last(model, index == len(micro_batches) - 1):
                loss_fn(model(mb["input_ids"]), mb).backward()
        with count_collectives() as end_calls:
            step_loss = loss_fn.end()
        assert dict(begin_calls) == {"all_reduce": 1} and dict(end_calls) == {"all_reduce": 1}
        torch.testing.assert_close(step_loss, ref_loss, rtol=1e-10, atol=0)
        for name, grad in full_grads(model).items():
            context = f"{mode=} {weighted=} {gradient_sync=} {name}"
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-10, atol=1e-13, msg=lambda m, c=context: f"{c}: {m}"
            )
            scale = ref_grads[name].abs().max()
            worst = max(worst, float((grad - ref_grads[name]).abs().max() / scale))
    if rank == 0:
        print(f"\n{wrapper} x{world}: largest relative gradient error {worst:.1e}", file=sys.stderr)


def _context_parallel_body(packed: bool) -> None:
    """CP=2 over the 2 ranks: each holds its load-balanced shard of every sequence."""
    rank = dist.get_rank()
    logits, batch, _ = ragged_padded_batch(weighted=True)  # sequence 2 scores nothing
    labels, weights = batch["labels"], batch["loss_mask"]
    mask = weights != 0

    def shard_of(batch: dict) -> dict:
        if packed:
            batch = pack_batch(batch, RAGGED_LENGTHS, pad_to_multiple_of=4)
            return get_packed_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=rank)
        return get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=rank)

    for mode, loss_mask in (("per_token", mask), ("per_sequence", weights), ("constant", mask)):
        ref_loss, ref_grad = reference_loss_and_grad(
            logits, labels, loss_mask, mode, **mode_kwargs(mode)
        )
        batch = {"labels": torch.where(loss_mask != 0, labels, -100), "loss_mask": loss_mask}
        if not packed:
            weight, start = sequence_normalizers(loss_mask)
            batch.update(sequence_weight=weight, sequence_start=start)
        shard = shard_of({**batch, "logits": logits.transpose(0, 1)})
        leaf = shard.pop("logits").detach().clone().requires_grad_(True)
        loss_fn = GlobalBatchLoss(
            normalization=mode, context_parallel_size=2, gradient_sync="sum", **mode_kwargs(mode)
        )
        loss_fn.begin([shard])
        loss_fn(leaf, shard).backward()
        torch.testing.assert_close(loss_fn.end(), ref_loss, rtol=1e-12, atol=0)
        # This rank's slice of the reference gradient, laid out as its shard.
        expected = shard_of({"logits": ref_grad.transpose(0, 1), "labels": labels})["logits"]
        torch.testing.assert_close(leaf.grad, expected, rtol=1e-10, atol=1e-15)


def _body() -> None:
    for wrapper in ("ddp", "fsdp2"):
        _train_step_body(wrapper)
    if dist.get_world_size() == 2:
        for packed in (False, True):
            _context_parallel_body(packed)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_fsdp2_and_context_parallel_steps_equal_one_process(world_size) -> None:
    # One spawn per world size: DDP, FSDP2 and (on 2 ranks) CP = 2, plain and packed.
    run_distributed(_body, world_size, megatron=False)
