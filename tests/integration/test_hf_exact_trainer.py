"""ExactMLMTrainer on 2 gloo processes: real ``transformers.Trainer`` + accelerate DDP runs.

Every case runs one after the other in one pair of spawned processes
(``tests/helpers/hf_trainer.run_jobs``); the references are one process on the unsplit batch
or eval set. The plain ``Trainer`` runs beside them where it is wrong.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.helpers import hf_trainer as H

EXACT = 1e-9
LOGGED = 1e-6


@pytest.mark.slow
def test_two_process_steps_and_evaluate_equal_one_process() -> None:
    # Training: global batch 8 over 2 processes; the heavily masked samples land first; with
    # accumulation 2 and 4 the last micro-batch of process 1 scores nothing, and with
    # accumulation 1 process 1 holds 4 masked tokens against process 0's 32.
    steps = [
        H.Case(kind, exact=True, accumulation=accumulation, average_tokens=average_tokens)
        for kind in ("esm", "bert")
        for accumulation in (1, 2, 4)
        for average_tokens in (True, False)
    ]
    steps += [H.Case(kind, exact=True, accumulation=2, fused_head=True) for kind in ("esm", "bert")]
    steps += [H.Case("bert", exact=False), H.Case("esm", exact=False, accumulation=2)]
    # Evaluation: 13 samples, eval batch 3 per process: the last global batch holds 1 real
    # sample and 5 duplicates added by the distributed sampler.
    evals = [
        H.Case(kind, exact=True, fused_head=fused_head, with_metrics=with_metrics)
        for kind in ("esm", "bert")
        for fused_head, with_metrics in ((False, True), (True, False))
    ]
    evals += [H.Case("bert", exact=False)]
    jobs = [("trainer_step", case) for case in steps] + [("trainer_eval", case) for case in evals]
    results = H.run_jobs(jobs, processes=2)
    step_results, eval_results = results[: len(steps)], results[len(steps) :]

    references = {kind: H.reference_step(kind) for kind in ("esm", "bert")}
    for case, result in zip(steps[:-2], step_results, strict=False):
        reference = references[case.kind]
        error = H.relative_error(result["grads"], reference["grads"])
        assert error <= EXACT, (case, error)
        assert H.relative(result["loss"], reference["loss"]) <= LOGGED, case
    bert_plain, esm_plain = step_results[-2:]
    # BERT without accumulation: gradient and logged loss x2 (average_tokens_across_devices
    # multiplies the loss by the process count, and BERT's loss is a plain mean).
    assert H.norm_ratio(bert_plain["grads"], references["bert"]["grads"]) > 1.5
    assert bert_plain["loss"] > 1.5 * references["bert"]["loss"]
    assert H.relative_error(esm_plain["grads"], references["esm"]["grads"]) > 0.1

    rows = H.samples(H.EVAL_LENGTHS, H.EVAL_MASKED, seed=1)
    eval_references = {kind: H.reference_eval(kind, rows) for kind in ("esm", "bert")}
    for case, result in zip(evals[:-1], eval_results, strict=False):
        metrics, reference = result["metrics"], eval_references[case.kind]
        assert H.relative(metrics["eval_loss"], reference) <= EXACT, case
        assert H.relative(metrics["eval_perplexity"], math.exp(reference)) <= EXACT, case
        if case.with_metrics:  # compute_metrics saw each sample once, with its logits
            assert result["metric_shapes"][1] == (13, H.SEQ_LEN)
    # The plain Trainer: BERT's eval_loss x2 (the process count), perplexity squared and more.
    assert eval_results[-1]["metrics"]["eval_loss"] > 1.9 * eval_references["bert"]
