"""output_layer_inputs: the fused head's inputs of a real Megatron-Core ``BertModel`` (CPU).

The fused head on them gives the loss and every parameter gradient of the model's own logits
path and of ``F.cross_entropy`` on those logits (fp64), with the output weight tied to the word
embeddings. Tensor and sequence parallelism: tests/integration/test_fused_head_tp.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("megatron.core")

import torch
import torch.nn.functional as F

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.megatron import output_layer_inputs
from tests.helpers.megatron_bert import mlm_batch, tiny_bert
from tests.helpers.megatron_cpu import GradSyncShell, megatron_on_cpu, single_process_megatron
from tests.helpers.sync_guard import forbid_host_syncs


@pytest.fixture
def megatron() -> Iterator[tuple[torch.nn.Module, dict, tuple[torch.Tensor, torch.Tensor]]]:
    """A tiny ``BertModel``, a batch and the model's inputs, under a one-rank parallel state."""
    with single_process_megatron(), megatron_on_cpu():
        model, batch = tiny_bert(), mlm_batch()
        yield model, batch, (batch["text"], batch["attention_mask"])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_fused_head_gives_the_logits_paths_loss_and_gradients(megatron) -> None:
    model, batch, inputs = megatron
    mask = batch["loss_mask"]

    logits, _ = model(*inputs)  # [b, s, v]
    reference = F.cross_entropy(logits[mask], batch["labels"][mask], reduction="sum")
    reference.backward()
    expected = _grads(model)

    for output, count in (("logits", None), ("fused", int(mask.sum())), ("fused", None)):
        loss_fn = BERTMLMLossWithReduction()
        loss_fn.setup({**batch, "num_scored": count} if count is not None else batch)
        if output == "fused":
            forward_out = output_layer_inputs(model, *inputs)
            assert forward_out["hidden_layout"] == "sb"
            assert forward_out["output_weight"] is model.embedding.word_embeddings.weight
            assert forward_out["output_bias"] is model.output_layer.bias
        else:
            forward_out = {"logits": model(*inputs)[0]}
        with forbid_host_syncs() if count is not None else torch.enable_grad():
            loss_sum, num_tokens, _ = loss_fn(forward_out)
        loss_sum.backward()
        assert int(num_tokens) == int(mask.sum())
        torch.testing.assert_close(loss_sum, reference.detach(), rtol=1e-12, atol=0)
        grads = _grads(model)
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-14, msg=name)
    # The output layer is the model's own again.
    assert "forward" not in vars(model.output_layer)
    torch.testing.assert_close(model(*inputs)[0], logits.detach(), rtol=0, atol=0)


def test_wrappers_a_bias_left_to_the_caller_and_earlier_pipeline_stages(megatron) -> None:
    model, _, inputs = megatron
    # Found through .module (Megatron's DDP and Float16Module, NeMo's modules); then with
    # skip_bias_add: the layer hands its bias to the caller, which Megatron's BERT drops.
    for wrapped, skip_bias_add in ((GradSyncShell(model), False), (model, True)):
        model.output_layer.skip_bias_add = skip_bias_add
        out = output_layer_inputs(wrapped, *inputs)
        assert (out["output_bias"] is None) == skip_bias_add
        logits = F.linear(out["hidden_states"], out["output_weight"], out["output_bias"])
        expected = model(*inputs)[0]  # [b, s, v]; logits [s, b, v]
        torch.testing.assert_close(logits.transpose(0, 1), expected, rtol=1e-12, atol=1e-14)
    # A stage before the last (no output layer) returns the hidden states it sends on.
    first = tiny_bert(post_process=False)
    hidden = output_layer_inputs(first, *inputs)
    torch.testing.assert_close(hidden, first(*inputs), rtol=0, atol=0)


def test_errors_name_the_problem_and_restore_the_layer(megatron) -> None:
    model, batch, inputs = megatron
    with pytest.raises(ValueError, match="without lm_labels"):
        output_layer_inputs(model, *inputs, lm_labels=batch["labels"])
    with pytest.raises(IndexError):  # a token id outside the embedding table
        output_layer_inputs(model, torch.full((1, 8), 10**6), batch["attention_mask"][:1])
    assert "forward" not in vars(model.output_layer)
    model.output_layer.config.defer_embedding_wgrad_compute = True
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        output_layer_inputs(model, *inputs)
