"""Plain ``transformers.Trainer`` against ``ExactMLMTrainer``: the table of docs/hf_trainer.md.

Tiny fp64 ``EsmForMaskedLM`` / ``BertForMaskedLM`` (dropout 0), one optimizer step with lr 0
on a global batch of 8 samples with uneven masking (11, 9, 7, 5, 3, 1, 0, 0 masked tokens),
the gradient read at ``on_pre_optimizer_step``; ``evaluate()`` on 13 samples with eval batch
3. References: one process on the unsplit batch / eval set, ``F.cross_entropy`` over its
masked tokens. Two-process rows run real gloo processes (accelerate's multi-CPU DDP). The
runs themselves are those of the tests (tests/helpers/hf_trainer.py).

    python bench/hf_trainer_exactness.py          # ~1 min on 2 busy cores

Errors: ``||g - g_ref|| / ||g_ref||`` over every parameter's gradient; ``norm x`` is
``||g|| / ||g_ref||``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

# The runs are the tests' own (tests/helpers/hf_trainer.py): make the repository importable
# when this runs as `python bench/hf_trainer_exactness.py`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import hf_trainer as H

RANDOM_SEEDS = (0, 1, 2, 3, 4)


def _step_jobs() -> tuple[list[H.Job], list[H.Job]]:
    one, two = [], []
    for exact in (False, True):
        for accumulation in (2, 4):
            one += [("trainer_step", H.Case("esm", exact, accumulation))]
            one += [
                ("trainer_step", H.Case("esm", exact, accumulation, sampling="random", seed=s))
                for s in RANDOM_SEEDS
            ]
            one += [("trainer_step", H.Case("bert", exact, accumulation))]
        for average_tokens in (True, False):
            two += [("trainer_step", H.Case("bert", exact, 1, average_tokens=average_tokens))]
        two += [("trainer_step", H.Case("esm", exact, 1))]
        one += [("trainer_eval", H.Case("esm", exact)), ("trainer_eval", H.Case("bert", exact))]
        two += [("trainer_eval", H.Case("esm", exact)), ("trainer_eval", H.Case("bert", exact))]
    return one, two


def main() -> None:
    start = time.perf_counter()
    evals = H.samples(H.EVAL_LENGTHS, H.EVAL_MASKED, seed=1)
    ref_step = {kind: H.reference_step(kind) for kind in ("esm", "bert")}
    ref_eval = {kind: H.reference_eval(kind, evals) for kind in ("esm", "bert")}
    one, two = _step_jobs()
    results = {}
    for processes, jobs in ((1, one), (2, two)):
        for (runner, case), result in zip(jobs, H.run_jobs(jobs, processes), strict=True):
            results[(runner, case, processes)] = result

    def step(kind, exact, accumulation=1, processes=1, **options):
        result = results[("trainer_step", H.Case(kind, exact, accumulation, **options), processes)]
        reference = ref_step[kind]
        return (
            H.relative_error(result["grads"], reference["grads"]),
            H.norm_ratio(result["grads"], reference["grads"]),
            result["loss"] / reference["loss"],
            result["micro_batch_losses"],
        )

    def evaluation(kind, exact, processes):
        metrics = results[("trainer_eval", H.Case(kind, exact), processes)]["metrics"]
        loss = metrics["eval_loss"]
        perplexity = metrics.get("eval_perplexity", math.exp(loss))
        return loss, perplexity, ref_eval[kind]

    rows = []
    for accumulation in (2, 4):
        cells = []
        for exact in (False, True):
            randoms = [
                step("esm", exact, accumulation, sampling="random", seed=s)[0] for s in RANDOM_SEEDS
            ]
            heavy = step("esm", exact, accumulation)[0]
            cells.append(
                f"{min(randoms):.2g}-{max(randoms):.2g} (random), {heavy:.3g} (heavy first)"
            )
        rows.append((f"`EsmForMaskedLM`, accumulation {accumulation}", *cells))
    for accumulation in (2, 4):
        cells = []
        for exact in (False, True):
            error, norm, logged, _ = step("bert", exact, accumulation)
            cells.append(f"{error:.3g}; norm x{norm:.3g}; logged loss x{logged:.3g}")
        rows.append((f"`BertForMaskedLM`, accumulation {accumulation}", *cells))
    for average_tokens in (True, False):
        cells = []
        for exact in (False, True):
            error, norm, logged, _ = step("bert", exact, 1, 2, average_tokens=average_tokens)
            cells.append(f"{error:.3g}; norm x{norm:.3g}; logged loss x{logged:.3g}")
        name = f"`BertForMaskedLM`, 2 processes, average_tokens_across_devices={average_tokens}"
        rows.append((name, *cells))
    cells = []
    for exact in (False, True):
        error, norm, logged, _ = step("esm", exact, 1, 2)
        cells.append(f"{error:.3g}; norm x{norm:.3g}; logged loss x{logged:.3g}")
    rows.append(("`EsmForMaskedLM`, 2 processes", *cells))
    cells = []
    for exact in (False, True):
        losses = step("esm", exact, 4)[3]
        cells.append(f"micro-batch losses {', '.join(f'{v:.3g}' for v in losses)}")
    rows.append(("`EsmForMaskedLM`, accumulation 4, last micro-batch with no masked token", *cells))
    for kind, processes in (("esm", 1), ("bert", 1), ("esm", 2), ("bert", 2)):
        cells = []
        for exact in (False, True):
            loss, perplexity, reference = evaluation(kind, exact, processes)
            cells.append(
                f"eval_loss {loss:.6g} ({loss / reference - 1:+.2e}); "
                f"perplexity {perplexity:.5g} ({perplexity / math.exp(reference) - 1:+.2e})"
            )
        model = "EsmForMaskedLM" if kind == "esm" else "BertForMaskedLM"
        name = f"`evaluate()`, `{model}`, {processes} process{'es' * (processes > 1)}"
        rows.append((f"{name}, exact {reference:.6g}", *cells))

    print("| configuration | plain `Trainer` | `ExactMLMTrainer` |")
    print("| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[:3]
    print(f"\n{time.perf_counter() - start:.0f} s; load average {' '.join(load)}")


if __name__ == "__main__":
    main()
