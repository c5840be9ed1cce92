from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bert_reduce
from bert_reduce import (
    BERTMLMLossWithReduction,
    MegatronLossReduction,
)
from tests.helpers.mode_reference import run_mode_microbatches as run_microbatches
from tests.helpers.reference import (
    make_head_batch,
    make_mlm_batch,
    reference_loss,
    reference_loss_and_grad,
    token_losses,
)


@pytest.mark.parametrize("sizes", [[1, 3, 2, 2], [5, 1, 1, 1], [2, 2, 2, 2], [8]])
def test_unequal_microbatches_with_empty_ones_match_full_batch(sizes) -> None:
    logits, labels, mask = make_mlm_batch(8, 10, 7, empty_rows=(0, 3, 4), mask_prob=0.25)
    loss, grad = run_microbatches(logits, labels, mask, sizes)
    ref_loss, ref_grad = reference_loss_and_grad(logits, labels, mask)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)


def test_mean_of_microbatch_means_would_differ() -> None:
    # Guards the test above against being vacuous: the split changes the mean of means.
    logits, labels, mask = make_mlm_batch(8, 10, 7, empty_rows=(0, 3, 4), mask_prob=0.25)
    per_mb = [reference_loss(logits[:, r], labels[r], mask[r]) for r in (slice(1, 4), slice(5, 8))]
    assert not torch.isclose(torch.stack(per_mb).mean(), reference_loss(logits, labels, mask))


def test_seed_000_example_ten_plus_six_tokens() -> None:
    # Two samples of 16 tokens: 10 masked in the first, 6 in the second.
    logits, labels, _ = make_mlm_batch(2, 16, 5, mask_prob=1.0)
    labels = labels.abs() % 5
    mask = torch.tensor([[1] * 10 + [0] * 6, [1] * 6 + [0] * 10], dtype=torch.bool)
    full, _ = run_microbatches(logits, labels, mask, [2])
    split, _ = run_microbatches(logits, labels, mask, [1, 1])
    per_token = token_losses(logits, labels, mask)
    expected = per_token[mask].sum() / 16
    torch.testing.assert_close(full, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(split, expected, rtol=1e-12, atol=0)
    mean_of_means = (per_token[0, :10].mean() + per_token[1, :6].mean()) / 2
    assert not torch.isclose(split, mean_of_means)


@pytest.mark.parametrize(
    ("options", "keys"),
    [
        # Validation included: NeMo keeps every report of a validation step until reduce, so
        # retaining logits is opt-in (send_val_output=True).
        ({}, {"loss_sum_and_microbatch_size"}),
        ({"validation_step": True}, {"loss_sum_and_microbatch_size"}),
        ({"validation_step": True, "send_val_output": True}, {"batch", "forward_out"}),
        ({"send_train_output": True}, {"batch", "forward_out"}),
    ],
)
def test_reports_hold_two_numbers_and_only_the_outputs_asked_for(options, keys) -> None:
    logits, labels, mask = make_mlm_batch(2, 8, 9)
    loss_fn = BERTMLMLossWithReduction(**options)
    loss_fn.setup({"labels": labels, "loss_mask": mask})
    _, _, report = loss_fn({"token_logits": logits.requires_grad_(True)})
    assert set(report) == keys | {"loss_sum_and_microbatch_size"}
    assert report["loss_sum_and_microbatch_size"].shape == (2,)
    assert report["loss_sum_and_microbatch_size"].dtype == torch.float64
    if "batch" in keys:
        assert not report["forward_out"]["token_logits"].requires_grad
        assert report["batch"]["labels"] is not labels
        assert torch.equal(report["batch"]["labels"], labels)


def test_bad_batches_options_and_outputs_are_named() -> None:
    logits, labels, mask = make_mlm_batch(2, 8, 9)
    batch = {"labels": labels, "loss_mask": mask}
    out = {"token_logits": logits}
    cases = [
        (
            {"ignore_index": None},
            {"labels": labels},
            out,
            KeyError,
            "batch has no 'loss_mask' and ignore_index=None",
        ),
        ({}, {**batch, "loss_mask": mask[:, :4]}, out, ValueError, r"\(2, 4\).*\(2, 8\)"),
        ({}, batch, {"lm_loss": torch.zeros(8, 2)}, ValueError, r"forward_out\['lm_loss'\]"),
        ({}, batch, {**out, "lm_loss": mask}, KeyError, "exactly one of .*forward_out_key"),
    ]
    for kernel in ("megatron", "megatron_fused"):
        match = rf"cross_entropy='{kernel}' runs Megatron-Core.*needs"
        cases.append(({"cross_entropy": kernel}, batch, out, ValueError, match))
    for options, micro_batch, forward_out, error, match in cases:
        loss_fn = BERTMLMLossWithReduction(**options)
        loss_fn.setup(micro_batch)
        with pytest.raises(error, match=match):
            loss_fn(forward_out)
    with pytest.raises(TypeError, match="cross_entropy_loss_fusion"):
        BERTMLMLossWithReduction(cross_entropy_loss_fusion=True)
    with pytest.raises(ValueError, match="forward_out_key must be one of"):
        BERTMLMLossWithReduction(forward_out_key="token_logit")


@pytest.mark.parametrize("output", ["logits", "sb", "bs"])
def test_out_of_vocab_masked_label_reported(output) -> None:
    # Logits, or the fused head's inputs in either layout (the loss on them against the
    # reference in every option: tests/test_engine.py).
    layout = output.replace("logits", "sb")
    hidden, weight, _, labels, mask = make_head_batch(mask_prob=1.0, layout=layout)
    labels[1, 3] = 42
    loss_fn = BERTMLMLossWithReduction(check_labels=True)
    loss_fn.setup({"labels": labels, "loss_mask": mask})
    forward_out = {"hidden_states": hidden, "hidden_layout": output, "output_weight": weight}
    if output == "logits":
        forward_out = {"token_logits": torch.nn.functional.linear(hidden, weight)}
    # Without check_labels, NaN: tests/test_cross_entropy.py and tests/test_linear_cross_entropy.py
    # (the kernels, every capacity).
    with pytest.raises(ValueError, match=r"outside \[0, 13\).*b=1, s=3.*42"):
        loss_fn(forward_out)


def test_all_matches_exports() -> None:
    assert issubclass(BERTMLMLossWithReduction, MegatronLossReduction)
    assert sorted(bert_reduce.__all__) == sorted(bert_reduce._EXPORTS)
    for name in bert_reduce.__all__:
        assert getattr(bert_reduce, name) is not None


@pytest.mark.parametrize(
    ("key", "forward_out_key"),
    [
        ("token_logits", None),
        ("logits", None),
        ("lm_loss", None),
        ("logits and lm_loss", "logits"),  # several outputs: forward_out_key says which
        ("logits and lm_loss", "lm_loss"),
    ],
)
def test_every_forward_out_layout_is_the_reference(key, forward_out_key) -> None:
    # b == s: a [b, s, v] tensor read as [s, b, v] would give another, wrong, loss.
    logits, labels, mask = make_mlm_batch(6, 6, 11, empty_rows=(2,))
    ref = reference_loss(logits, labels, mask)
    # The same micro-batch as each model family emits it: keyed by layout.
    bsv = {"logits": logits.transpose(0, 1).contiguous()}
    per_token = {
        "lm_loss": F.cross_entropy(logits.permute(1, 2, 0), labels.clamp(min=0), reduction="none")
    }
    outputs = {"token_logits": {"token_logits": logits}, "logits": bsv, "lm_loss": per_token}
    outputs["logits and lm_loss"] = {**bsv, **per_token}
    loss_fn = BERTMLMLossWithReduction(forward_out_key=forward_out_key)
    loss_fn.setup({"labels": labels, "loss_mask": mask})
    loss_sum, num_tokens, report = loss_fn(outputs[key])
    torch.testing.assert_close(loss_sum / num_tokens, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(loss_fn.reduce([report]), ref.float(), rtol=0, atol=0)
    if key == "logits":  # the same tensor under the [s, b, v] key: another, wrong, loss
        wrong, count, _ = loss_fn({"token_logits": bsv["logits"]})
        assert not torch.isclose(wrong / count, ref)
