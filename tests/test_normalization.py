from __future__ import annotations

import pytest
import torch

from bert_reduce import (
    BERTMLMLossWithReduction,
    Normalization,
)
from bert_reduce.normalization import (
    normalization_weights,
    sequence_normalizers,
    token_loss_sum,
)
from tests.helpers.mode_reference import MODES, float_weights, mode_kwargs
from tests.helpers.reference import make_mlm_batch, reference_loss
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs


def test_modes_differ_so_the_split_tests_can_fail() -> None:
    # Every mode under any split: tests/integration/test_properties.py, against these values.
    logits, labels, mask = make_mlm_batch(8, 10, 7, empty_rows=(0, 3, 4), mask_prob=0.3)
    values = [reference_loss(logits, labels, mask, mode, **mode_kwargs(mode)) for mode in MODES]
    assert len({round(float(v), 6) for v in values}) == 3
    weighted = reference_loss(logits, labels, float_weights(mask), "per_token")
    assert not torch.isclose(weighted, values[0])


def test_per_sequence_worked_example() -> None:
    # Row 0: tokens 1, 3 scored (mean 2); row 1: none; row 2: token 10 scored (mean 10).
    per_token = torch.tensor(
        [[1.0, 5.0, 3.0], [7.0, 7.0, 7.0], [10.0, 0.0, 0.0]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    numerator, denominator = token_loss_sum(per_token, mask, "per_sequence")
    assert int(denominator) == 2
    torch.testing.assert_close(numerator / denominator, torch.tensor(6.0, dtype=torch.float64))


def test_constant_worked_example_and_validation() -> None:
    per_token = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [0, 1]], dtype=torch.bool)
    numerator, denominator = token_loss_sum(
        per_token, mask, Normalization.CONSTANT, constant_per_sequence=8
    )
    assert int(denominator) == 16
    torch.testing.assert_close(numerator, torch.tensor(7.0, dtype=torch.float64))
    # The options' own checks (mode names, constant_per_sequence): tests/test_engine.py.
    with pytest.raises(ValueError, match="constant_per_sequence"):
        token_loss_sum(per_token, mask, "constant")
    with pytest.raises(ValueError, match=r"sequence_weight of shape \(2, 1\)"):
        token_loss_sum(
            per_token,
            mask,
            "per_sequence",
            sequence_weight=torch.ones(2, 1),
            sequence_start=torch.ones(2, 2, dtype=torch.bool),
        )


def test_sequence_normalizers_from_cu_seqlens() -> None:
    mask = torch.tensor([[1, 0, 1, 0, 0, 1, 1, 0, 1]], dtype=torch.bool)
    cu = torch.tensor([0, 3, 3, 5, 8], dtype=torch.int32)  # segments 3, empty, 2, 3; 1 trailing
    weight, start = sequence_normalizers(mask, cu)
    assert weight.tolist() == [[2, 2, 2, 0, 0, 2, 2, 2, 0]]
    assert start.tolist() == [[True, False, False, True, False, True, False, False, False]]
    with pytest.raises(ValueError, match=r"expected \[1, T\]"):
        sequence_normalizers(mask.expand(2, -1), cu)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("validation_step", [False, True])
def test_forward_and_reduce_have_no_host_sync_and_no_collective(mode, validation_step) -> None:
    logits, labels, mask = make_mlm_batch(4, 8, 9)
    logits.requires_grad_(True)
    with forbid_host_syncs(), count_collectives() as calls:
        loss_fn = BERTMLMLossWithReduction(
            normalization=mode, validation_step=validation_step, **mode_kwargs(mode)
        )
        loss_fn.setup({"labels": labels, "loss_mask": float_weights(mask)})
        numerator, _, report = loss_fn({"token_logits": logits})
        numerator.backward()
        BERTMLMLossWithReduction().reduce([report, report])
    assert sum(calls.values()) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", ["bool", "int", "float", "float, weight_resolution"])
@pytest.mark.parametrize("packed", [False, True])
def test_normalization_weights_give_the_numerator_and_denominator_up_front(
    mode, mask_kind, packed
) -> None:
    # The fused head weights every token before any loss exists: its sum of weights * losses
    # must be token_loss_sum's numerator, with the same denominator, in every mode.
    _, _, mask = make_mlm_batch(4, 10, 7, empty_rows=(2,), mask_prob=0.4)
    options = mode_kwargs(mode)
    if mask_kind == "int":
        mask = mask.to(torch.int32) * 2
    elif mask_kind.startswith("float"):
        mask = float_weights(mask, dyadic=mask_kind.endswith("resolution"))
        if mask_kind.endswith("resolution") and mode == "per_token":
            options["weight_resolution"] = 256
    if packed:
        mask = mask.reshape(1, -1)
        cu_seqlens = torch.tensor([0, 7, 7, 19, 33, 40])
        options.update(zip(("sequence_weight", "sequence_start"),
                           sequence_normalizers(mask, cu_seqlens), strict=True))  # fmt: skip
    # NaN and inf losses where nothing is scored must not reach either numerator.
    loss = torch.rand(mask.shape, dtype=torch.float64) * 5
    loss = torch.where(mask != 0, loss, torch.tensor([torch.nan, torch.inf])[mask.shape[1] % 2])
    numerator, denominator = token_loss_sum(loss, mask, mode, **options)
    with forbid_host_syncs():
        weights, up_front = normalization_weights(mask, mode, dtype=torch.float64, **options)
    assert weights.dtype == torch.float64 and weights.shape == mask.shape
    assert torch.equal(up_front, denominator) and up_front.dtype == denominator.dtype
    scored = weights != 0
    assert torch.equal(scored, mask != 0)
    torch.testing.assert_close(
        (weights[scored] * loss[scored]).sum(), numerator, rtol=1e-14, atol=0
    )
    # A negative weight makes the sum NaN, as token_loss_sum's does.
    negative = mask.double().flatten()
    negative[(mask != 0).flatten().nonzero()[0]] = -0.5
    negative = negative.view(mask.shape)
    options.pop("weight_resolution", None)
    numerator, _ = token_loss_sum(loss, negative, mode, **options)
    weights, _ = normalization_weights(negative, mode, dtype=torch.float64, **options)
    assert numerator.isnan() and weights.isnan().sum() == 1
