"""lm_head_inputs: the fused head's inputs of Hugging Face ESM and BERT masked LMs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from bert_reduce import linear_cross_entropy_token_losses
from bert_reduce.hf import lm_head_inputs
from tests.helpers import hf_trainer as H
from tests.helpers.hf_esm import esm_batch


@pytest.mark.parametrize("kind", ["esm", "bert"])
def test_head_inputs_reproduce_the_logits_and_their_gradients(kind: str) -> None:
    batch = esm_batch([9, 5, 7], 9, [3, 0, 2])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    labels = batch["labels"]

    reference = H.tiny_model(kind)
    logits = reference(**inputs).logits
    scored = labels != -100
    F.cross_entropy(logits[scored], labels[scored], reduction="sum").backward()

    model = H.tiny_model(kind)
    out = lm_head_inputs(model, **inputs)
    assert out["hidden_layout"] == "bs" and out["hidden_states"].shape == (3, 9, 16)
    assert out["output_weight"].shape == (logits.size(-1), 16)
    torch.testing.assert_close(
        F.linear(out["hidden_states"], out["output_weight"], out["output_bias"]),
        logits.detach(),
        rtol=1e-12,
        atol=1e-12,
    )
    losses = linear_cross_entropy_token_losses(
        out["hidden_states"],
        out["output_weight"],
        torch.where(scored, labels, 0),
        scored,
        bias=out["output_bias"],
        layout="bs",
    )
    losses.sum().backward()
    for (name, expected), param in zip(
        reference.named_parameters(), model.parameters(), strict=True
    ):
        if expected.grad is None:
            assert param.grad is None or not param.grad.any(), name
            continue
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-10, atol=1e-12, msg=name)
    # The head is the model's own again.
    assert "forward" not in vars(model.lm_head if kind == "esm" else model.cls)
    torch.testing.assert_close(model(**inputs).logits, logits.detach(), rtol=1e-12, atol=1e-12)


def test_head_is_restored_after_an_error_and_bad_calls_are_named() -> None:
    model = H.tiny_model("esm")
    with pytest.raises(IndexError):  # a token id outside the embedding table
        lm_head_inputs(model, input_ids=torch.full((2, 3), 10**6))
    assert "forward" not in vars(model.lm_head)
    with pytest.raises(ValueError, match="without 'labels'"):
        lm_head_inputs(model, input_ids=torch.ones(2, 3, dtype=torch.long), labels=None)
    with pytest.raises(TypeError, match="EsmForMaskedLM and BertForMaskedLM"):
        lm_head_inputs(torch.nn.Linear(2, 2), input=torch.ones(2))
