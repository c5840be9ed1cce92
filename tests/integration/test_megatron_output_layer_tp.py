"""output_layer_inputs under tensor parallelism (TP = 2) and sequence parallelism, 2 gloo ranks.

A real Megatron-Core ``BertModel`` (tied embeddings, the output layer's weight a vocab shard):

* TP = 2: the fused head's loss and every parameter gradient equal those of the same model
  at TP = 1 back-propagating ``F.cross_entropy`` over its logits (this rank's shard of each
  gradient; fp64), and the TP = 2 logits path;
* TP = 2 with sequence parallelism (Megatron's ``BertModel`` needs Transformer Engine's or
  Apex's LayerNorm for it, so the last stage is written out: the ``[s, b, h]`` hidden states
  scattered into ``[s/tp, b, h]`` shards, then Megatron's own ``ColumnParallelLinear``): loss
  and gradients equal ``F.linear`` + ``F.cross_entropy`` at TP = 1 and the logits path (the
  shards are all-gathered, their gradient reduce-scattered).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch
from torch import nn

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.megatron import output_layer_inputs
from tests.helpers.dist_utils import run_distributed
from tests.helpers.megatron_bert import HIDDEN, SEQ_LEN, VOCAB, mlm_batch, tiny_bert
from tests.helpers.megatron_cpu import megatron_on_cpu, single_process_megatron
from tests.helpers.reference import linear_reference, make_head_batch, reference_loss

pytestmark = pytest.mark.slow


def _loss_and_grads(batch: dict, forward_out: dict, leaves: list) -> tuple[torch.Tensor, tuple]:
    """The loss class's sum on ``forward_out`` and its gradients w.r.t. ``leaves``."""
    loss_fn = BERTMLMLossWithReduction()
    loss_fn.setup({**batch, "num_scored": int(batch["loss_mask"].sum())})
    loss_sum, _, _ = loss_fn(forward_out)
    return loss_sum.detach(), torch.autograd.grad(loss_sum, leaves)


def _body(reference: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = mlm_batch()
    with megatron_on_cpu():
        model = tiny_bert()
        ref_loss, ref_grads = reference
        inputs = (batch["text"], batch["attention_mask"])
        named = dict(model.named_parameters())
        for fused in (True, False):
            out = output_layer_inputs(model, *inputs) if fused else {"logits": model(*inputs)[0]}
            loss, grads = _loss_and_grads(batch, out, list(named.values()))
            torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
            for (name, param), grad in zip(named.items(), grads, strict=True):
                expected = ref_grads[name]
                if getattr(param, "tensor_model_parallel", False):
                    expected = expected.chunk(2, dim=param.partition_dim)[tp_rank]
                torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-13, msg=name)
        _sequence_parallel_checks(batch, tp_rank)


class SequenceParallelLastStage(nn.Module):
    """``[s, b, h]`` -> this rank's ``[s/tp, b, h]`` shard -> Megatron's ``ColumnParallelLinear``.

    What the last stage of a sequence-parallel Megatron language model does before its logits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, tp_rank: int) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.transformer.transformer_config import TransformerConfig

        super().__init__()
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            use_cpu_initialization=True,
            params_dtype=torch.float64,
        )
        self.output_layer = ColumnParallelLinear(
            HIDDEN, VOCAB, config=config, init_method=nn.init.zeros_, bias=True
        )
        with torch.no_grad():
            self.output_layer.weight.copy_(weight.chunk(2)[tp_rank])
            self.output_layer.bias.copy_(bias.chunk(2)[tp_rank])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        logits, _ = self.output_layer(scatter_to_sequence_parallel_region(hidden))
        return logits  # [s, b, v/tp]


def _sequence_parallel_checks(batch: dict, tp_rank: int) -> None:
    hidden, weight, bias, _, _ = make_head_batch(
        batch["labels"].size(0), SEQ_LEN, HIDDEN, VOCAB, seed=4
    )
    losses, *ref_grads = linear_reference(
        hidden, weight, bias, batch["labels"], batch["loss_mask"].double()
    )
    for output in ("fused", "logits"):
        stage = SequenceParallelLastStage(weight, bias, tp_rank)
        leaf = hidden.clone().requires_grad_(True)
        if output == "fused":
            forward_out = output_layer_inputs(stage, leaf)
            assert forward_out["hidden_states"].shape == hidden.shape  # gathered, whole
        else:
            forward_out = {"token_logits": stage(leaf)}
        layer = stage.output_layer
        loss_sum, grads = _loss_and_grads(batch, forward_out, [leaf, layer.weight, layer.bias])
        torch.testing.assert_close(loss_sum, losses.sum(), rtol=1e-12, atol=0)
        expected = (ref_grads[0], *(grad.chunk(2)[tp_rank] for grad in ref_grads[1:]))
        for grad, ref, name in zip(grads, expected, ("hidden", "weight", "bias"), strict=True):
            torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-13, msg=f"{output} {name}")


def test_tensor_and_sequence_parallel_fused_head_equals_one_process() -> None:
    with single_process_megatron(), megatron_on_cpu():
        model = tiny_bert()
        batch = mlm_batch()
        logits, _ = model(batch["text"], batch["attention_mask"])
        loss = reference_loss(logits.transpose(0, 1), batch["labels"], batch["loss_mask"], "sum")
        loss.backward()
        reference = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    run_distributed(_body, 2, reference, tp=2)
