"""bert_reduce.engine: every integration takes every loss option and gives the same sums.

References and tolerances: docs/guarantees.md. ``ExactMLMModule`` takes a loss instance, so the
``BERTMLMLossWithReduction`` row covers it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from bert_reduce import BERTMLMLossWithReduction, GlobalBatchLoss, LossOptions, TokenPerplexity
from bert_reduce.engine import loss_terms, scored_weights
from bert_reduce.hf import ExactMLMTrainer, lm_head_inputs
from bert_reduce.hf.exact_trainer import LOSS_ONLY_KEYS
from tests.helpers import hf_trainer as H
from tests.helpers.megatron_cpu import single_process_megatron
from tests.helpers.reference import reference_loss

CONSTANT = 20
OPTIONS = {
    "defaults": {},
    "per_sequence": {"normalization": "per_sequence"},
    "constant": {"normalization": "constant", "constant_per_sequence": CONSTANT},
    "float weights, weight_resolution": {"weight_resolution": 4},
    "capacity all": {"capacity": "all"},
    "capacity 0.5": {"capacity": 0.5},
    "capacity nonzero": {"capacity": "nonzero"},
    "num_scored": {},
    "ignore_index None, loss_mask": {"ignore_index": None},
    "megatron": {"cross_entropy": "megatron"},
    "megatron_fused": {"cross_entropy": "megatron_fused"},
}


def _batch(case: str) -> dict[str, torch.Tensor]:
    batch = H.stack(H.samples(H.TRAIN_LENGTHS, H.TRAIN_MASKED))
    scored = batch["labels"] != -100
    if case == "float weights, weight_resolution":
        quarters = torch.arange(scored.numel()).view(scored.shape) % 5 + 1  # 0.25 .. 1.25
        batch["loss_mask"] = torch.where(scored, quarters / 4, 0).double()
    elif case == "ignore_index None, loss_mask":
        batch["loss_mask"] = scored
    elif case == "num_scored":
        batch["num_scored"] = int(scored.sum())
    return batch


def _megatron_loss(batch, out, options, tmp_path):
    loss_fn = BERTMLMLossWithReduction(layout="bs", **options)
    loss_fn.setup(batch)
    numerator, denominator, _ = loss_fn(out)
    return numerator, denominator


def _global_batch_loss(batch, out, options, tmp_path):
    loss_fn = GlobalBatchLoss(group=None, **options)
    denominator = loss_fn.begin([batch])
    loss_fn(out, batch)
    return loss_fn.end() * denominator, denominator


def _trainer(batch, out, options, tmp_path):
    model = H.tiny_model("esm")
    trainer = ExactMLMTrainer(
        model=model, args=H.training_arguments(str(tmp_path)), fused_head=isinstance(out, dict),
        **options,
    )  # fmt: skip
    model.train()
    batches, denominator = trainer.get_batch_samples(iter([dict(batch)]), 1, torch.device("cpu"))
    share = trainer.compute_loss(model, batches[0], num_items_in_batch=denominator)
    return share * denominator, denominator


def _perplexity(batch, out, options, tmp_path):
    metric = TokenPerplexity()
    metric.update_from_logits(out, batch["labels"], batch.get("loss_mask"), layout="bs", **options)
    return metric.loss_sum, metric.denominator


INTEGRATIONS = {
    "BERTMLMLossWithReduction": _megatron_loss,
    "GlobalBatchLoss": _global_batch_loss,
    "ExactMLMTrainer": _trainer,
    "TokenPerplexity.update_from_logits": _perplexity,
}


@pytest.mark.parametrize("output", ["logits", "hidden_states"])
@pytest.mark.parametrize("case", OPTIONS)
@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_every_integration_takes_every_option_and_gives_the_reference_sums(
    integration, case, output, tmp_path
) -> None:
    if integration.startswith("TokenPerplexity") and output == "hidden_states":
        pytest.skip("perplexity is fed logits")
    options = OPTIONS[case]
    megatron = "cross_entropy" in options
    with single_process_megatron() if megatron else contextlib.nullcontext():
        batch = _batch(case)
        model = H.tiny_model("esm").train()
        inputs = {key: value for key, value in batch.items() if key not in LOSS_ONLY_KEYS}
        logits = model(**inputs).logits.detach()  # [b, s, v]
        out = lm_head_inputs(model, **inputs) if output == "hidden_states" else logits
        numerator, denominator = INTEGRATIONS[integration](batch, out, options, tmp_path)

    weights = scored_weights(batch).double()
    mode = LossOptions(**options).normalization.value
    expected = reference_loss(
        logits.transpose(0, 1), batch["labels"], weights, mode, constant_per_sequence=CONSTANT
    )
    tolerance = 1e-6 if megatron else 1e-12
    quotient = numerator.double() / denominator.double()
    torch.testing.assert_close(quotient, expected, rtol=tolerance, atol=0)
    expected_denominator = {
        "per_token": weights.sum() * (4 if "weight_resolution" in options else 1),
        "per_sequence": (weights.sum(dim=1) != 0).sum().double(),
        "constant": torch.tensor(CONSTANT * weights.size(0), dtype=torch.float64),
    }[mode]
    assert denominator.double() == expected_denominator


def test_options_are_checked_once_with_the_valid_values() -> None:
    for bad, match in [
        ({"normalization": "per_tokens"}, "choose one of 'per_token', 'per_sequence', 'constant'"),
        ({"normalization": "constant"}, "needs a positive constant_per_sequence"),
        ({"cross_entropy": "fused"}, "one of 'masked', 'megatron', 'megatron_fused'"),
        ({"capacity": 1.5}, r"fractional capacity must lie in \(0, 1\]"),
        ({"weight_resolution": 0}, "weight_resolution must be positive"),
    ]:
        for build in (LossOptions, BERTMLMLossWithReduction, GlobalBatchLoss):
            with pytest.raises(ValueError, match=match):
                build(**bad)
    with pytest.raises(TypeError, match="mask_capacity"):
        GlobalBatchLoss(mask_capacity=0.5)
    fields = {field.name for field in dataclasses.fields(LossOptions)}
    assert fields == {
        *("normalization", "constant_per_sequence", "weight_resolution", "capacity"),
        *("cross_entropy", "ignore_index"),
    }


def test_bad_forward_outputs_and_batches_are_named() -> None:
    labels = torch.tensor([[1, -100, 2]])
    options = LossOptions()
    with pytest.raises(TypeError, match="forward_out must be a logits tensor or a mapping"):
        loss_terms({"labels": labels}, [torch.zeros(1, 3, 4)], options, layout="bs")
    with pytest.raises(ValueError, match=r"logits of shape \(3, 1, 4\) must be \[b, s, v\]"):
        loss_terms({"labels": labels}, torch.zeros(3, 1, 4), options, layout="bs")
    with pytest.raises(ValueError, match="layout must be 'bs'"):
        loss_terms({"labels": labels}, torch.zeros(1, 3, 4), options, layout="bsv")
    with pytest.raises(KeyError, match="batch has no 'labels' key"):
        loss_terms({"label": labels}, torch.zeros(1, 3, 4), options, layout="bs")
    with pytest.raises(TypeError, match=r"batch\['loss_mask'\] must be a torch.Tensor"):
        scored_weights({"labels": labels, "loss_mask": [[1, 0, 1]]})
    # -100 where scored by the mask: unscored, unless ignore_index=None says the mask decides.
    mask = torch.ones(1, 3)
    assert torch.equal(scored_weights({"labels": labels, "loss_mask": mask}), labels != -100)
    assert torch.equal(scored_weights({"labels": labels, "loss_mask": mask}, None), mask)
    assert torch.equal(scored_weights({"labels": labels}, 2), labels != 2)
