"""``torch.compile`` of the loss class on hidden states: one graph, few recompiles, exact.

With the micro-batch's count given as a Python ``int``, ``BERTMLMLossWithReduction`` on the
fused head (``linear_cross_entropy_weighted_sum``) must be captured whole (``fullgraph=True``),
equal eager mode, and serve micro-batches whose counts differ with a few graphs: under compile the
number of row chunks follows the count's bucket
(``bert_reduce.linear_cross_entropy.compile_bucket``), the shapes the count itself.
``aot_eager`` proves capture and runs the compiled backward; inductor (slow) generates code.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from bert_reduce import BERTMLMLossWithReduction, pack_batch
from tests.helpers.mode_reference import MODES, mode_kwargs
from tests.helpers.reference import make_head_batch, reference_loss

# Compiling takes seconds per graph: the whole module runs in CI, outside the fast set.
pytestmark = pytest.mark.slow

B, S, H, V = 4, 64, 8, 37


def micro_batch(count: int, seed: int) -> dict[str, Any]:
    """``[b, s]`` labels and a mask with exactly ``count`` scored positions, and the count."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B * S, dtype=torch.bool)
    mask[torch.randperm(B * S, generator=gen)[:count]] = True
    mask = mask.view(B, S)
    labels = torch.where(mask, torch.randint(0, V, (B, S), generator=gen), -100)
    return {"labels": labels, "loss_mask": mask, "num_scored": count}


def step(loss_fn, call, batch, hidden, leaves) -> tuple[torch.Tensor, ...]:
    """``numerator / denominator`` of one micro-batch and the gradients of the three leaves."""
    for leaf in leaves:
        leaf.grad = None
    loss_fn.setup(batch)
    numerator, denominator, _ = call(
        {"hidden_states": hidden, "output_weight": leaves[1], "output_bias": leaves[2]}
    )
    loss = numerator / denominator
    loss.backward()
    return loss.detach(), *(leaf.grad.clone() for leaf in leaves)


def inputs(
    batch: dict[str, Any], hidden: torch.Tensor, packed: bool
) -> tuple[dict[str, Any], torch.Tensor]:
    """The micro-batch and its hidden states, as given or packed into one ``[1, T]`` row."""
    if not packed:
        return batch, hidden
    packed_batch = pack_batch({**batch, "hidden": hidden.transpose(0, 1)}, [S] * B)
    assert packed_batch["num_scored"] == batch["num_scored"]  # an int survives packing
    return packed_batch, packed_batch.pop("hidden").transpose(0, 1)


def run_micro_batches(
    backend: str, counts: list[int], mode: str = "per_token", packed: bool = False
) -> list[torch.fx.GraphModule]:
    """Compiled vs eager vs the reference on every micro-batch; returns the graphs compiled."""
    torch._dynamo.reset()
    counters.clear()
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)  # every graph dynamo hands the backend
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    options = mode_kwargs(mode, S)
    loss_fn = BERTMLMLossWithReduction(normalization=mode, **options)
    compiled = torch.compile(loss_fn, fullgraph=True, backend=recording)
    leaves = [t.requires_grad_(True) for t in make_head_batch(B, S, H, V)[:3]]
    for seed, count in enumerate(counts):
        # Compiling imports modules (inductor's); a guard on sys.modules would recompile.
        sys.modules[f"{__name__}.imported_{seed}"] = types.ModuleType("imported")
        plain = micro_batch(count, seed)
        got = step(loss_fn, compiled, *inputs(plain, leaves[0], packed), leaves)
        eager = step(loss_fn, loss_fn, *inputs(plain, leaves[0], packed), leaves)
        for name, a, e in zip(("loss", "hidden", "weight", "bias"), got, eager, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14, msg=f"{name}, {count}")
        ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        logits = F.linear(*ref_leaves)
        ref = reference_loss(logits, plain["labels"], plain["loss_mask"], mode, **options)
        ref.backward()
        torch.testing.assert_close(got[0], ref.detach(), rtol=1e-10, atol=0)
        for a, ref_leaf in zip(got[1:], ref_leaves, strict=True):
            torch.testing.assert_close(a, ref_leaf.grad, rtol=1e-10, atol=1e-12)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs


def counts_from_9_to_21_percent() -> list[int]:
    counts = torch.linspace(0.09, 0.21, 10) * B * S
    return [int(c) for c in counts.round()]


def test_ten_micro_batches_masked_9_to_21_percent_compile_at_most_4_graphs() -> None:
    counts = counts_from_9_to_21_percent()
    assert len(set(counts)) == 10
    graphs = run_micro_batches("aot_eager", counts)
    # The first count compiles a static graph; the others share one dynamic graph per bucket
    # of b * s / 16 = 16 rows: 23 (static), 26..32, 33..48, 50..54.
    assert 2 <= len(graphs) <= 4, len(graphs)


# Packing matters to the modes that see sequences; one of them packed is enough here.
@pytest.mark.parametrize(("mode", "packed"), [*((m, False) for m in MODES), ("per_sequence", True)])
def test_every_mode_compiles_whole_and_equals_eager(mode, packed) -> None:
    run_micro_batches("aot_eager", [23, 31], mode=mode, packed=packed)


def test_inductor_compiles_few_graphs_equal_to_eager() -> None:
    counts = counts_from_9_to_21_percent()
    graphs = run_micro_batches("inductor", counts[:2] + counts[-2:])
    assert len(graphs) <= 3, len(graphs)
