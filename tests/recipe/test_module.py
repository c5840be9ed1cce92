"""The recipe's module with the fused masked-only head: same gradients, counts kept on the CPU."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from bert_reduce import BERTMLMLossWithReduction
from bert_reduce.recipe.config import ModelConfig
from bert_reduce.recipe.data import MLMCollator, MLMDataset, PackedMicroBatchCollator
from bert_reduce.recipe.model import ESM2Model
from bert_reduce.recipe.module import ESM2MLMModule
from tests.helpers.reference import assert_close_by_name
from tests.helpers.sync_guard import forbid_host_syncs

# No dropout: the fused and the logits forward passes must see the same network.
TINY = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, dropout=0.0)


def samples(count: int = 6) -> list[dict[str, torch.Tensor]]:
    sequences = ["MKVLAAGIW", "MSTNPKPQRKTKRNTNRRPQDVKFPGG", "MAL", "MGSSHHHHHHSSGLVPRGSH", "MPEP"]
    dataset = MLMDataset(sequences * 2, max_length=24, mask_prob=0.3)
    return [dataset[index] for index in range(count)]


def gradients(model: ESM2Model, batch: dict, mode: str) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    module = ESM2MLMModule(model, micro_batch_size=len(batch["labels"]))
    forward_out = module(batch)
    loss_fn = BERTMLMLossWithReduction(
        normalization=mode, constant_per_sequence=24 if mode == "constant" else None
    )
    loss_fn.setup(batch)
    with forbid_host_syncs():
        numerator, denominator, _ = loss_fn(forward_out)
    loss = numerator / denominator
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["per_token", "per_sequence", "constant"])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_head_gives_the_gradients_of_the_logits(mode, packed) -> None:
    model = ESM2Model(TINY).double()
    batch = (
        PackedMicroBatchCollator(6)(samples())["micro_batches"][0]
        if packed
        else MLMCollator()(samples())
    )
    assert "num_scored" in batch
    fused_loss, fused_grads = gradients(model, batch, mode)
    model.fused_head = False
    dense_loss, dense_grads = gradients(model, batch, mode)
    torch.testing.assert_close(fused_loss, dense_loss, rtol=1e-12, atol=0)
    assert_close_by_name(fused_grads, dense_grads, rtol=1e-10, atol=1e-13)


def test_counts_stay_host_ints_through_lightnings_own_batch_transfer() -> None:
    """No transfer hook of ours (Lightning warns about one beside a datamodule): ints survive."""
    module = ESM2MLMModule(ESM2Model(TINY), micro_batch_size=2)
    for hook in ("transfer_batch_to_device", "on_before_batch_transfer", "on_after_batch_transfer"):
        assert not is_overridden(hook, module), hook
    # Padded batches: tests/lightning/test_exact_module.py (ExactMLMModule's split).
    packed = PackedMicroBatchCollator(2)(samples(4))
    moved = module.transfer_batch_to_device(packed, torch.device("meta"), 0)
    for micro_batch, original in zip(
        module.micro_batches(moved), packed["micro_batches"], strict=True
    ):
        assert micro_batch["input_ids"].device.type == "meta"
        count = int(original["loss_mask"].sum())
        assert micro_batch["num_scored"] == original["num_scored"] == count
