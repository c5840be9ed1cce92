"""The fused head in a PyTorch loop: ``lm_head_inputs`` + ``GlobalBatchLoss`` on DDP and FSDP2."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from bert_reduce import GlobalBatchLoss
from bert_reduce.num_scored import count_scored
from tests.helpers.dist_utils import full_grads, run_distributed, sync_on_last
from tests.helpers.hf_esm import esm_batch, tiny_esm_config

pytest.importorskip("transformers")

from transformers import EsmForMaskedLM

from bert_reduce.hf import lm_head_inputs
from tests.helpers import hf_trainer as H

pytestmark = pytest.mark.slow

SEQ_LEN = 24
# Per rank: two micro-batches of two rows; masked tokens per row (rank 0: 35, rank 1: 5).
ROWS = {0: ([20, 24, 18, 24], [9, 10, 8, 8]), 1: ([24, 12, 20, 16], [2, 0, 3, 0])}


def _model(kind: str) -> torch.nn.Module:
    model = H.tiny_model(kind)
    if kind == "esm":
        model.esm.contact_head.requires_grad_(False)  # not on the masked-LM path
    return model


def _wrap(model: torch.nn.Module, kind: str, wrapper: str, mesh: DeviceMesh | None):
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    if wrapper == "ddp_find_unused":  # Hugging Face Trainer's default
        return DistributedDataParallel(model, find_unused_parameters=True)
    layers = model.esm.encoder.layer if kind == "esm" else model.bert.encoder.layer
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model, micro_batches, head: str, **loss_kwargs) -> torch.Tensor:
    """One training step of ``micro_batches`` through the loss; returns the step's loss."""
    loss_fn = GlobalBatchLoss(**loss_kwargs)
    # outputs.loss goes around the loss: begin() then has no micro-batch of its own.
    loss_fn.begin([] if head == "outputs.loss" else micro_batches)
    for index, mb in enumerate(micro_batches):
        inputs = {"input_ids": mb["input_ids"], "attention_mask": mb["attention_mask"]}
        with sync_on_last(model, index == len(micro_batches) - 1):
            if head == "outputs.loss":  # what a Hugging Face loop does: the mean, over steps
                (model(**inputs, labels=mb["labels"]).loss / len(micro_batches)).backward()
                continue
            output = lm_head_inputs(model, **inputs) if head == "fused" else model(**inputs).logits
            loss_fn(output, mb).backward()
    return loss_fn.end()


def _body() -> None:
    torch.set_default_dtype(torch.float64)
    rank = dist.get_rank()
    batches = {r: esm_batch(ROWS[r][0], SEQ_LEN, ROWS[r][1], seed=r) for r in ROWS}
    whole = {k: torch.cat([batches[r][k] for r in ROWS]) for k in batches[0]}
    mine = batches[rank]
    micro_batches = [{k: v[rows] for k, v in mine.items()} for rows in (slice(0, 2), slice(2, 4))]
    for mb in micro_batches:
        mb["num_scored"] = count_scored(mb)  # what NumScoredCollator adds, on the host
    for kind in ("esm", "bert"):
        reference = _model(kind)
        ref_loss = H.cross_entropy_mean(reference, whole)
        ref_loss.backward()
        ref_grads = full_grads(reference)
        # The fused head under each wrapper; the logits and outputs.loss beside it under FSDP2.
        cases = [("ddp", "fused"), ("ddp_find_unused", "fused"), ("fsdp2", "fused")]
        if kind == "esm":
            cases += [("fsdp2", "logits"), ("fsdp2", "outputs.loss")]
        for wrapper, head in cases:
            model = _wrap(_model(kind), kind, wrapper, None)
            loss = _step(model, micro_batches, head)
            if head != "outputs.loss":
                torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
            worst = 0.0
            for name, grad in full_grads(model).items():
                ref = ref_grads[name]
                if ref is None:
                    assert grad is None, name
                    continue
                # Attention's key bias has a zero gradient (softmax ignores a shift of a
                # whole row): ~1e-22 of round-off on both sides, measured against 1e-6.
                scale = max(float(ref.abs().max()), 1e-6)
                worst = max(worst, float((grad - ref).abs().max()) / scale)
            if head == "outputs.loss":  # Hugging Face's mean over the steps: a mean of means
                assert worst > 0.1, worst
            else:
                assert worst < 1e-10, (kind, wrapper, head, worst)

    # An untied head in a unit of its own: FSDP2 would free its weight before the loss. Named,
    # not crashed.
    untied = EsmForMaskedLM(tiny_esm_config(tie_word_embeddings=False))
    fully_shard(untied.lm_head)
    fully_shard(untied)
    inputs = {key: micro_batches[0][key] for key in ("input_ids", "attention_mask")}
    with pytest.raises(ValueError, match=r"unit 'lm_head'.*Leave the prediction head in the root"):
        lm_head_inputs(untied, **inputs)

    # FSDP2 ranks holding different numbers of micro-batches, in a group whose collectives time
    # out after a minute: without the check this run would hang in FSDP2's all-gathers; with
    # it, begin() raises on both ranks before any forward.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    splits = (slice(0, 2), slice(2, 4)) if rank == 0 else (slice(0, 4),)
    unequal = [{k: v[rows] for k, v in mine.items()} for rows in splits]
    model = _wrap(_model("esm"), "esm", "fsdp2", DeviceMesh.from_group(group, "cpu"))
    with pytest.raises(ValueError) as error:
        _step(model, unequal, "fused", group=group, equal_micro_batch_counts=True)
    message = str(error.value)
    assert "different numbers of micro-batches ({0: 2, 1: 1} by rank" in message, message
    assert f"this rank, {rank}, holds {2 if rank == 0 else 1}" in message


def test_ddp_and_fsdp2_equal_one_process_and_unequal_fsdp2_counts_raise() -> None:
    run_distributed(_body, 2, megatron=False)
