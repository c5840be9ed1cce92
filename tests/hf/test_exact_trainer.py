"""ExactMLMTrainer in one process: real ``transformers.Trainer`` runs against the unsplit batch.

Each run is one optimizer step with lr 0 (or one ``evaluate()``) of a tiny fp64 masked LM,
beside the plain ``Trainer`` where it gets the value wrong. Two processes: tests/integration.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from transformers import DataCollatorWithFlattening, Trainer

from bert_reduce.engine import LossOptions, mode_terms, scored_weights
from bert_reduce.hf import ExactMLMTrainer
from bert_reduce.hf.exact_trainer import sample_loss_terms
from tests.helpers import hf_trainer as H

EXACT = 1e-9  # relative, fp64
LOGGED = 1e-6  # Trainer accumulates the logged loss in fp32


def _exact_step(tmp_path, model, rows, **kwargs) -> tuple:
    args = H.training_arguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        **kwargs.pop("args", {}),
    )
    trainer = ExactMLMTrainer(model=model, args=args, train_dataset=rows, **kwargs)
    return trainer, H.step_gradient(trainer)


@pytest.mark.parametrize("kind", ["esm", "bert"])
@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_step_gradient_and_logged_loss_are_the_unsplit_batch(kind: str, accumulation: int) -> None:
    # Heavily masked samples first; with accumulation 4 the last micro-batch scores nothing.
    reference = H.reference_step(kind)
    (result,) = H.run_jobs([("trainer_step", H.Case(kind, exact=True, accumulation=accumulation))])
    assert H.relative_error(result["grads"], reference["grads"]) <= EXACT
    assert H.relative(result["loss"], reference["loss"]) <= LOGGED
    # Each micro-batch's share is finite (an empty one's is 0, not NaN) and they sum to the loss.
    shares = result["micro_batch_losses"]
    assert len(shares) == accumulation and all(math.isfinite(share) for share in shares)
    assert math.isclose(sum(shares), reference["loss"], rel_tol=EXACT)
    assert shares[-1] == 0.0 if accumulation == 4 else shares[-1] > 0


@pytest.mark.parametrize(
    ("kind", "accumulation", "smallest_error"),
    # ESM: a mean of micro-batch means; BERT: `forward(**kwargs)` makes Trainer skip the
    # division by the accumulation steps, but its loss is still a plain mean.
    [("esm", 4, 0.3), ("bert", 2, 1.0)],
)
def test_plain_trainer_step_is_off(kind: str, accumulation: int, smallest_error: float) -> None:
    reference = H.reference_step(kind)
    (plain,) = H.run_jobs([("trainer_step", H.Case(kind, exact=False, accumulation=accumulation))])
    assert H.relative_error(plain["grads"], reference["grads"]) > smallest_error
    if accumulation == 4:  # the empty last micro-batch's mean
        assert math.isnan(plain["micro_batch_losses"][-1])


@pytest.mark.parametrize("kind", ["esm", "bert"])
def test_evaluate_is_the_exact_mean_over_the_eval_set(kind: str) -> None:
    # 13 samples, eval batch 3: a partial last batch; compute_metrics still gets every logit.
    reference = H.reference_eval(kind, H.samples(H.EVAL_LENGTHS, H.EVAL_MASKED, seed=1))
    (result,) = H.run_jobs([("trainer_eval", H.Case(kind, exact=True, with_metrics=True))])
    metrics = result["metrics"]
    assert H.relative(metrics["eval_loss"], reference) <= EXACT
    assert H.relative(metrics["eval_perplexity"], math.exp(reference)) <= EXACT
    vocab = H.tiny_model(kind).config.vocab_size
    assert result["metric_shapes"] == ((13, H.SEQ_LEN, vocab), (13, H.SEQ_LEN))
    assert 0.0 <= metrics["eval_masked_accuracy"] <= 1.0


def test_batch_losses_are_batch_means_and_plain_eval_loss_their_mean() -> None:
    rows = H.samples(H.EVAL_LENGTHS, H.EVAL_MASKED, seed=1)
    reference = H.reference_eval("bert", rows)
    cases = [H.Case("bert", exact=True), H.Case("bert", exact=False)]
    exact, plain = H.run_jobs([("trainer_eval", case) for case in cases])
    means = [H.reference_eval("bert", rows[start : start + 3]) for start in range(0, 13, 3)]
    # Each eval batch's loss, as prediction_step returns it, is the batch's own exact mean.
    assert exact["batch_losses"] == pytest.approx(means, rel=1e-12)
    # The plain eval_loss: the mean of the 5 batch means, weighted by their sizes (the last: 1).
    mean_of_means = sum(m * n for m, n in zip(means, [3, 3, 3, 3, 1], strict=True)) / 13
    assert math.isclose(plain["metrics"]["eval_loss"], mean_of_means, rel_tol=1e-12)
    assert H.relative(plain["metrics"]["eval_loss"], reference) > 1e-4


@pytest.mark.parametrize("kind", ["esm", "bert"])
def test_fused_head_is_exact_and_forms_logits_only_for_compute_metrics(kind: str, tmp_path) -> None:
    reference = H.reference_step(kind)
    eval_rows = H.samples(H.EVAL_LENGTHS, H.EVAL_MASKED, seed=1)
    eval_reference = H.reference_eval(kind, eval_rows)
    model = H.tiny_model(kind)
    decoder = model.lm_head.decoder if kind == "esm" else model.cls.predictions.decoder
    decoder_calls = []
    decoder.register_forward_pre_hook(lambda m, a: decoder_calls.append(model.training))
    trainer, grads = _exact_step(
        tmp_path,
        model,
        H.samples(H.TRAIN_LENGTHS, H.TRAIN_MASKED),
        args={"per_device_eval_batch_size": 3},
        eval_dataset=eval_rows,
        fused_head=True,
    )  # lr 0: evaluate() sees the initial model
    assert decoder_calls == []  # no [b, s, v] logits in training
    assert H.relative_error(grads, reference["grads"]) <= EXACT
    # No compute_metrics: the loss alone, fused; with one, the logits it needs.
    assert H.relative(trainer.evaluate()["eval_loss"], eval_reference) <= EXACT
    assert decoder_calls == []
    trainer.compute_metrics = lambda prediction: {}
    assert H.relative(trainer.evaluate()["eval_loss"], eval_reference) <= EXACT
    assert decoder_calls and not any(decoder_calls)


def _packable_rows() -> list[dict[str, list[int]]]:
    """Unpadded samples behind a ``<cls>`` token (never masked: the flattening collator
    replaces the first label of every sequence by its separator)."""
    rows = zip(H.samples(H.TRAIN_LENGTHS, H.TRAIN_MASKED), H.TRAIN_LENGTHS, strict=True)
    return [
        {
            key: [first, *row[key][:length].tolist()]
            for key, first in (("input_ids", 0), ("labels", -100))
        }
        for row, length in rows
    ]


@pytest.mark.parametrize("flash_attn_kwargs", [False, True])
def test_packed_batches_count_each_sequence(flash_attn_kwargs: bool, tmp_path) -> None:
    # Hugging Face's DataCollatorWithFlattening: one [1, T] row per micro-batch, sequences
    # marked by position_ids restarting at 0 (and cu_seq_lens_q with flash_attn_kwargs); in
    # per-sequence mode, the mean of the sequences' means.
    rows = _packable_rows()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_attn_kwargs)
    model = H.tiny_model("esm")
    means = []
    for start in (0, 4):  # the two micro-batches, as the trainer sees them
        packed = collator(rows[start : start + 4])
        assert packed["input_ids"].shape[0] == 1
        logits = model(**{k: v for k, v in packed.items() if k != "labels"}).logits[0]
        labels = packed["labels"][0]
        sequence_ids = (packed["position_ids"][0] == 0).cumsum(0)
        for index in sequence_ids.unique().tolist():
            scored = (labels != -100) & (sequence_ids == index)
            if scored.any():
                means.append(F.cross_entropy(logits[scored], labels[scored]))
    loss = torch.stack(means).mean()
    loss.backward()
    trainer, grads = _exact_step(
        tmp_path,
        H.tiny_model("esm"),
        rows,
        data_collator=collator,
        normalization="per_sequence",
    )
    assert H.relative_error(grads, H.grads(model)) <= EXACT
    assert H.relative(H.logged_losses(trainer)[0], loss.item()) <= LOGGED


def _unlabelled(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "labels"} for row in rows]


def test_predict_without_labels_keeps_trainers_metrics(tmp_path) -> None:
    args = H.training_arguments(str(tmp_path), per_device_eval_batch_size=3)
    trainer = ExactMLMTrainer(model=H.tiny_model("esm"), args=args)
    output = trainer.predict(_unlabelled(H.samples(H.EVAL_LENGTHS, H.EVAL_MASKED, seed=1)))
    assert output.predictions.shape == (13, H.SEQ_LEN, 33)
    assert "test_loss" not in output.metrics and "test_perplexity" not in output.metrics


def test_bad_arguments_raise_clear_errors(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    args = H.training_arguments(str(tmp_path))
    model = H.tiny_model("esm")
    with pytest.raises(ValueError, match="compute_loss_func"):
        ExactMLMTrainer(model=model, args=args, compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(TypeError, match="fused_head=True supports"):
        ExactMLMTrainer(model=torch.nn.Linear(2, 2), args=args, fused_head=True)
    smoothing = H.training_arguments(str(tmp_path), label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        ExactMLMTrainer(model=model, args=smoothing)
    rows = _unlabelled(H.samples(H.TRAIN_LENGTHS, H.TRAIN_MASKED))
    trainer = ExactMLMTrainer(model=model, args=args, train_dataset=rows)
    with pytest.raises(KeyError, match="labels"):
        trainer.train()
    monkeypatch.delattr(Trainer, "loss_is_scaled_for_ga")
    with pytest.raises(RuntimeError, match=r"tested with transformers 5\.24"):
        ExactMLMTrainer(model=model, args=args)


# --- The model's inputs, and the per-sample terms of evaluation batches -----------------------


@pytest.mark.parametrize("mode", ["per_token", "per_sequence", "constant"])
@pytest.mark.parametrize("layout", ["rows", "position_ids", "cu_seq_lens_q"])
def test_sample_terms_are_each_samples_own_terms(mode: str, layout: str) -> None:
    # A sample is a row, or a sequence of DataCollatorWithFlattening's [1, T] row: its terms
    # are those it has as a batch of its own, and they sum to the batch's.
    if layout == "rows":
        batch = H.stack(H.samples(H.TRAIN_LENGTHS, H.TRAIN_MASKED))
        parts = [(slice(row, row + 1), slice(None)) for row in range(8)]
    else:
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=layout == "cu_seq_lens_q")
        batch = collator(_packable_rows())
        if layout == "cu_seq_lens_q":
            del batch["position_ids"]
        bounds = [0, *torch.tensor(H.TRAIN_LENGTHS).add(1).cumsum(0).tolist()]  # <cls> + sample
        parts = [(slice(None), slice(bounds[i], bounds[i + 1])) for i in range(8)]
    options = LossOptions(normalization=mode, constant_per_sequence=7)
    weights = scored_weights(batch)
    losses = torch.rand(weights.shape, dtype=torch.float64)
    samples = sample_loss_terms(batch, weights, losses, options)
    assert samples.shape == (8, 2)
    numerator, denominator = mode_terms(batch, weights, losses, options)
    torch.testing.assert_close(samples.sum(0), torch.stack([numerator, denominator.double()]))
    for sample, (rows, columns) in zip(samples, parts, strict=True):
        alone = {"labels": batch["labels"][rows, columns]}
        pair = mode_terms(alone, weights[rows, columns], losses[rows, columns], options)
        torch.testing.assert_close(sample, torch.stack([pair[0], pair[1].double()]))
