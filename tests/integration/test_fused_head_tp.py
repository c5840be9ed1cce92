"""The fused masked-only LM head under tensor parallelism (TP = 2) and sequence parallelism, on
2 gloo ranks with Megatron's TP.

* ``linear_cross_entropy_token_losses``, ``linear_cross_entropy_weighted_sum`` and the loss class
  on hidden states, each rank holding half of the vocabulary (and, with sequence parallelism, a
  sequence shard of the hidden states): the losses (or their weighted sum) and gradients must
  equal F.linear + F.cross_entropy on the whole vocabulary, with ONE collective in the forward.
* ``output_layer_inputs`` on a real Megatron-Core ``BertModel`` (tied embeddings, the output
  layer's weight a vocab shard): the fused head's loss and every parameter gradient equal those
  of the same model at TP = 1 back-propagating ``F.cross_entropy`` over its logits (this rank's
  shard of each gradient; fp64), and the TP = 2 logits path.
* ``output_layer_inputs`` with sequence parallelism (Megatron's ``BertModel`` needs Transformer
  Engine's or Apex's LayerNorm for it, so the last stage is written out,
  :class:`SequenceParallelLastStage`): loss and gradients equal ``F.linear`` + ``F.cross_entropy``
  at TP = 1 and the logits path (the shards are all-gathered, their gradient reduce-scattered).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch
import torch.distributed as dist
from torch import nn

from bert_reduce import BERTMLMLossWithReduction, linear_cross_entropy_token_losses
from bert_reduce.linear_cross_entropy import linear_cross_entropy_weighted_sum
from bert_reduce.megatron import output_layer_inputs
from tests.helpers.dist_utils import run_distributed
from tests.helpers.megatron_bert import CONFIG, HIDDEN, SEQ_LEN, VOCAB, mlm_batch, tiny_bert
from tests.helpers.megatron_cpu import megatron_on_cpu, single_process_megatron
from tests.helpers.reference import linear_reference, make_head_batch, reference_loss
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

pytestmark = pytest.mark.slow

CHUNKS = {"chunk_rows": 4, "chunk_vocab": 3}
SHARD = VOCAB // 2
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _shard_leaves(hidden, weight, bias, tp_rank: int, hidden_rows=slice(None)) -> list:
    cols = slice(tp_rank * SHARD, (tp_rank + 1) * SHARD)
    leaves = [hidden[hidden_rows].clone(), weight[cols].clone(), bias[cols].clone()]
    return [leaf.requires_grad_(True) for leaf in leaves]


def _check_shard_grads(leaves, reference, tp_rank: int, scale: float = 1.0, hidden_rows=None):
    """The weight's and bias's are this rank's vocab shard of the reference's (times ``scale``).

    The hidden states': on a sequence shard (``hidden_rows``), its rows, whole (Megatron's
    reduce-scatter summed the ranks'); else, as with F.linear on a vocab shard, this rank's
    part, summed over TP ranks (Megatron's copy_to_tensor_model_parallel_region).
    """
    from megatron.core import parallel_state

    cols = slice(tp_rank * SHARD, (tp_rank + 1) * SHARD)
    _, ref_hidden, ref_weight, ref_bias = reference
    torch.testing.assert_close(leaves[1].grad, ref_weight[cols] * scale, **TOL)
    torch.testing.assert_close(leaves[2].grad, ref_bias[cols] * scale, **TOL)
    if hidden_rows is not None:
        torch.testing.assert_close(leaves[0].grad, ref_hidden[hidden_rows] * scale, **TOL)
        return
    hidden_grad = leaves[0].grad.clone()
    dist.all_reduce(hidden_grad, group=parallel_state.get_tensor_model_parallel_group())
    torch.testing.assert_close(hidden_grad, ref_hidden * scale, **TOL)


def _linear_cross_entropy_checks(tp_rank: int, sequence_parallel: bool) -> None:
    half = SEQ_LEN // 2
    rows = slice(tp_rank * half, (tp_rank + 1) * half) if sequence_parallel else None
    hidden, weight, bias, labels, mask = make_head_batch(
        3, SEQ_LEN, 5, VOCAB, mask_prob=0.4, seed=3
    )
    coef = mask * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    reference = linear_reference(hidden, weight, bias, labels, coef)
    counts = mask.sum(dim=1)
    options = {"sequence_parallel": sequence_parallel, **CHUNKS}
    # The weighted sum accumulates its gradients in the forward, after the one all-reduce (two
    # passes over the shard's chunks), and scales them by the upstream gradient in backward.
    runs = {False: [("all", None), ("nonzero", None), (0.6, None), (1, counts)]}
    runs[True] = [("all", None), (None, None), (0.6, None), (1, int(mask.sum()))]
    for weighted_sum, (capacity, num_scored) in ((w, run) for w in runs for run in runs[w]):
        leaves = _shard_leaves(hidden, weight, bias, tp_rank, rows or slice(None))
        head = (
            linear_cross_entropy_weighted_sum if weighted_sum else linear_cross_entropy_token_losses
        )
        capacity_option = {} if capacity is None else {"capacity": capacity}
        scale = 0.5 if weighted_sum else 1.0
        with megatron_on_cpu(), count_collectives() as calls:
            out = head(
                leaves[0], leaves[1], labels, coef.double() if weighted_sum else mask,
                bias=leaves[2], num_scored=num_scored, **capacity_option, **options,
            )  # fmt: skip
            (scale * (out if weighted_sum else (out * coef).sum())).backward()
        if not sequence_parallel:
            assert dict(calls) == {"all_reduce": 1}, (weighted_sum, capacity, dict(calls))
        expected = (reference[0] * coef).sum() if weighted_sum else reference[0]
        torch.testing.assert_close(out, expected, **TOL)
        _check_shard_grads(leaves, reference, tp_rank, scale=scale, hidden_rows=rows)
    if sequence_parallel:
        return

    # Through the loss reduction, with the collator's CPU count: one collective, no sync.
    leaves = _shard_leaves(hidden, weight, bias, tp_rank)
    loss_fn = BERTMLMLossWithReduction()
    loss_fn.setup({"labels": labels, "loss_mask": mask, "num_scored": counts})
    forward_out = {"hidden_states": leaves[0], "output_weight": leaves[1], "output_bias": leaves[2]}
    with forbid_host_syncs(), count_collectives() as calls:
        loss_sum, num_tokens, _ = loss_fn(forward_out)
        loss_sum.backward()
    assert dict(calls) == {"all_reduce": 1} and int(num_tokens) == int(mask.sum())
    _check_shard_grads(
        leaves, linear_reference(hidden, weight, bias, labels, mask.double()), tp_rank
    )


def _loss_and_grads(batch: dict, forward_out: dict, leaves: list) -> tuple[torch.Tensor, tuple]:
    """The loss class's sum on ``forward_out`` and its gradients w.r.t. ``leaves``."""
    loss_fn = BERTMLMLossWithReduction()
    loss_fn.setup({**batch, "num_scored": int(batch["loss_mask"].sum())})
    loss_sum, _, _ = loss_fn(forward_out)
    return loss_sum.detach(), torch.autograd.grad(loss_sum, leaves)


def _body(reference: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for sequence_parallel in (False, True):
        _linear_cross_entropy_checks(tp_rank, sequence_parallel)
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
    """``[s, b, h]`` -> this rank's ``[s/tp, b, h]`` shard -> a ``ColumnParallelLinear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, tp_rank: int) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.transformer.transformer_config import TransformerConfig

        super().__init__()
        config = TransformerConfig(
            **CONFIG,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
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
