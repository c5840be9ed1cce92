"""BERTMLMLossWithReduction inside NeMo 2's MegatronParallel, on CPU, against one pass.

``MegatronParallel`` drives Megatron-Core's schedule over micro-batches of the example module
(``examples/nemo2_esm2_loss.py``), building its loss objects as NeMo's strategy does. NeMo's
own loss reports (``loss_sum_and_ub_size``) reduce through bert_reduce, mixed with its own.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from nemo.lightning import MegatronStrategy
from nemo.lightning import megatron_parallel as nemo_mp
from torch import Tensor

import bert_reduce
from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.metrics import TokenPerplexity
from examples.nemo2_esm2_loss import (
    MLMLightningModule,
    mlm_config,
    mlm_data_step,
    nemo_trainer,
)
from tests.helpers.dist_utils import run_distributed
from tests.helpers.megatron_bert import mlm_batch
from tests.helpers.megatron_cpu import GradSync, megatron_on_cpu, single_process_megatron
from tests.helpers.reference import assert_close_by_name, make_mlm_batch, reference_loss

GLOBAL_BATCH, SEQ_LEN, VOCAB = 8, 16, 33
EMPTY_ROW = 3
# Micro-batches as global row indices: unequal sizes and masked counts, one with no masked
# token at all (row EMPTY_ROW alone).
MICRO_BATCHES = [[0, 1, 2], [EMPTY_ROW], [4, 5, 6, 7]]
# Per data-parallel rank: 4 vs 4 samples in training, 5 vs 3 in validation (no drop_last).
DP_MICRO_BATCHES = {
    "train": [[[0, 1, 2], [EMPTY_ROW]], [[4], [5, 6, 7]]],
    "val": [[[0, 1], [2, EMPTY_ROW, 4]], [[5, 6, 7]]],
}


class _RecordingModule(GradSync, MLMLightningModule):
    """The example module in fp64, recording every loss object NeMo asks it for and, as a
    MegatronParallel callback, the per-micro-batch reports handed to ``reduce``."""

    def __init__(self) -> None:
        config = mlm_config()
        # What NeMo's MegatronOptimizerModule installs.
        config.finalize_model_grads_func = finalize_model_grads
        super().__init__(config=config, vocab_size=VOCAB, val_drop_last=False)
        self.created_losses: list[BERTMLMLossWithReduction] = []
        self.reports: list[dict[str, Any]] = []
        torch.manual_seed(0)
        self.configure_model()
        self.to(torch.float64)
        self.trainer = pl.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False
        )

    def training_loss_reduction(self) -> BERTMLMLossWithReduction:
        loss = super().training_loss_reduction()
        self.created_losses.append(loss)
        return loss

    def validation_loss_reduction(self) -> BERTMLMLossWithReduction:
        loss = super().validation_loss_reduction()
        # The tests read each micro-batch's batch and logits back from the reports.
        loss.send_val_output = True
        self.created_losses.append(loss)
        return loss

    def on_megatron_reduce_microbatches_end(self, microbatch_outputs: list[Any]) -> None:
        self.reports = list(microbatch_outputs)


def _global_batch() -> dict[str, Tensor]:
    return mlm_batch(GLOBAL_BATCH, 11, SEQ_LEN, mask_prob=0.25, empty_rows=(EMPTY_ROW,))


def _run(
    module: _RecordingModule, batch: dict[str, Tensor], micro_batches: list[list[int]], step: str
) -> tuple[Tensor, list[dict[str, Any]]]:
    """One NeMo step over ``micro_batches``: the reduced loss and the micro-batch reports.

    The loss is passed per call (NeMo's strategy does; a loss given to the constructor would
    become a submodule).
    """
    parallel = nemo_mp.MegatronParallel(
        module, cpu=True, callbacks=nemo_mp.CallbackConnector([module])
    )
    step_fn = parallel.training_step if step == "train" else parallel.validation_step
    data = iter([{key: value[rows] for key, value in batch.items()} for rows in micro_batches])
    with megatron_on_cpu():
        loss = step_fn(
            data,
            num_microbatches=len(micro_batches),
            seq_length=SEQ_LEN,
            micro_batch_size=max(len(rows) for rows in micro_batches),
            step_i=0,
        )
    return loss, module.reports


def test_the_loss_is_a_nemo_loss_and_nemos_reports_mix_with_its_own() -> None:
    assert bert_reduce.MegatronLossReduction is nemo_mp.MegatronLossReduction
    assert isinstance(BERTMLMLossWithReduction(), nemo_mp.MegatronLossReduction)
    logits, labels, mask = make_mlm_batch(6, 8, 11, empty_rows=(3,))
    ref = reference_loss(logits, labels, mask)
    reports = []
    with single_process_megatron():
        for start in (0, 2, 4):
            rows = slice(start, start + 2)
            batch = {"labels": labels[rows], "loss_mask": mask[rows]}
            if start != 2:  # NeMo's own loss, on per-token losses
                per_token = F.cross_entropy(
                    logits[:, rows].permute(1, 2, 0), labels[rows].clamp(min=0), reduction="none"
                )
                nemo_loss = nemo_mp.MaskedTokenLossReduction()
                nemo_loss.setup(batch)
                _, _, report = nemo_loss(per_token)
                assert set(report) == {"loss_sum_and_ub_size"}
            else:
                loss_fn = BERTMLMLossWithReduction()
                loss_fn.setup(batch)
                _, _, report = loss_fn({"token_logits": logits[:, rows]})
            reports.append(report)
        reduced = BERTMLMLossWithReduction().reduce(reports)
    torch.testing.assert_close(reduced, ref.float(), rtol=1e-6, atol=0)
    metric = TokenPerplexity()
    metric.update_from_reports(reports)
    torch.testing.assert_close(metric.compute(), ref.exp(), rtol=1e-6, atol=0)


def _step_is_the_global_batch_in_one_pass(micro_batches: list[list[int]], step: str) -> list:
    """A NeMo step on this rank's ``micro_batches``: the loss and gradients of the whole batch
    in one pass; returns the micro-batches' counts (summed over DP x CP: the batch's)."""
    from megatron.core.utils import get_batch_on_this_cp_rank as megatron_cp_slicer

    batch = _global_batch()
    module = _RecordingModule()
    # F.cross_entropy over the masked tokens of the whole batch, and its gradients.
    model = copy.deepcopy(module.module)
    logits = model(batch["text"])["token_logits"]
    ref_loss = reference_loss(logits, batch["labels"], batch["loss_mask"])
    names, params = zip(*model.named_parameters(), strict=True)
    ref_grads = dict(zip(names, torch.autograd.grad(ref_loss, params), strict=True))
    loss, reports = _run(module, batch, micro_batches, step)
    torch.testing.assert_close(loss, ref_loss.detach().float(), rtol=1e-6, atol=0)
    # NeMo built one loss per micro-batch and another for reduce, which never saw a batch.
    losses = module.created_losses
    assert len({id(loss) for loss in losses}) == len(micro_batches) + 1
    assert losses[-1].batch is None
    if step == "train":
        grads = {name: param.grad for name, param in module.module.named_parameters()}
        assert_close_by_name(grads, ref_grads, rtol=1e-5, atol=1e-7)
        assert all(set(report) == {"loss_sum_and_microbatch_size"} for report in reports)
    else:
        assert all(param.grad is None for param in module.parameters())
        # The loss saw this rank's load-balanced chunks, as Megatron's own slicer cuts them.
        for rows, report in zip(micro_batches, reports, strict=True):
            full = {key: batch[key][rows] for key in ("labels", "loss_mask")}
            expected = megatron_cp_slicer(full)
            for key in full:
                torch.testing.assert_close(report["batch"][key], expected[key])
            logits = report["forward_out"]["token_logits"]
            assert logits.shape == (expected["labels"].shape[1], len(rows), VOCAB)
            assert not logits.requires_grad
    counts = [int(report["loss_sum_and_microbatch_size"][1]) for report in reports]
    total = torch.tensor(sum(counts), dtype=torch.float64)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    assert int(total) == int(batch["loss_mask"].sum())
    return counts


@pytest.mark.parametrize("step", ["train", "val"])
def test_a_step_is_the_global_batch_in_one_pass(step: str) -> None:
    with single_process_megatron():
        counts = _step_is_the_global_batch_in_one_pass(MICRO_BATCHES, step)
    mask = _global_batch()["loss_mask"]
    assert counts == [int(mask[rows].sum()) for rows in MICRO_BATCHES] and counts[1] == 0


def test_example_builds_the_megatron_flags() -> None:
    assert mlm_config().calculate_per_token_loss
    trainer = nemo_trainer(context_parallel_size=2, accelerator="cpu")
    assert isinstance(trainer.strategy, MegatronStrategy)
    assert trainer.strategy.context_parallel_size == 2
    assert not trainer.strategy.ddp_config.average_in_collective
    # NeMo's strategy hands data_step (batch, batch_idx, dataloader_idx) triples.
    batch = _global_batch()
    stepped = mlm_data_step(iter([(batch, 0, 0)]))
    assert stepped.keys() == batch.keys()
    assert all(stepped[key] is batch[key] for key in batch)


def _dp_cp_body() -> None:
    for step in ("train", "val"):
        micro_batches = DP_MICRO_BATCHES[step][parallel_state.get_data_parallel_rank()]
        _step_is_the_global_batch_in_one_pass(micro_batches, step)


@pytest.mark.slow
def test_data_and_context_parallel_ranks_are_the_global_batch_in_one_pass() -> None:
    """DP=2 x CP=2: each rank its rows and its load-balanced sequence chunks (data_step)."""
    run_distributed(_dp_cp_body, 4, cp=2)
