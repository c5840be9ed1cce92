"""The plain-loop examples under ``torchrun`` on CPU: any split of a step, the same numbers.

One launch per number of processes runs both examples' ``train()`` for several configurations
(tests/helpers/example_runs.py), all on the same global batch of 12. The reference runs are
one FSDP2 process on the unsplit global batch (``--micro-batch-size 12``) evaluating the whole
validation set as one batch; their last ``val_loss`` is Hugging Face's own ``outputs.loss`` of
the trained model over that set, and ``val_ppl = exp(val_loss)``. Every other run, FSDP2 or
Accelerate, prints the same training losses, gradient norms and validation values. The first
sequence of every global batch scores nothing, so a micro-batch of 1 is empty; a validation
set of 2 sequences on 3 ranks leaves rank 0 without any.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from tests.helpers.recipe_runs import ENV, ROOT

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Two steps, each followed by a validation, of a tiny ESM-2 on short sequences.
COMMON = "--steps 2 --val-every 1 --global-batch-size 12 --dtype float64 --max-length 32 "
COMMON += "--hidden-size 16 --num-heads 2"
SMALL, FP32 = "--val-size 2", "--dtype float32"
FP64_REL, FP32_REL = 1e-9, 2e-5


def torchrun(nproc: int, runs: list[str]) -> list[dict[str, dict]]:
    """Per run: ``{"step": {S: (loss, grad_norm)}, "val": {S: (L, P)}, "reference": L}``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "tests.helpers.example_runs"]
    result = subprocess.run(
        command + runs, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parsed = []
    for text in re.split(r"^run \d+$", result.stdout, flags=re.M)[1:]:
        number = r"(-?[\d.]+|nan)"
        train = re.findall(rf"^step (\d+) loss {number} grad_norm {number}$", text, re.M)
        val = re.findall(rf"^val step (\d+) val_loss {number} val_ppl {number}$", text, re.M)
        (reference,) = re.findall(rf"^reference val_loss {number}$", text, re.M)
        parsed.append(
            {
                "step": {int(s): (float(a), float(b)) for s, a, b in train},
                "val": {int(s): (float(a), float(b)) for s, a, b in val},
                "reference": float(reference),
            }
        )
    assert len(parsed) == len(runs), result.stdout[-3000:]
    return parsed


def fsdp2(micro: int, val: int, more: str = "") -> str:
    return f"torch_fsdp2_loop {COMMON} --micro-batch-size {micro} --val-batch-size {val} {more}"


def accelerate(k: int, val: int, more: str = "") -> str:
    return (
        f"accelerate_loop {COMMON} --gradient-accumulation-steps {k} --val-batch-size {val} {more}"
    )


def assert_same(run: dict, expected: dict, rel: float) -> None:
    assert sorted(run["step"]) == [1, 2] and sorted(run["val"]) == [1, 2]
    for key in ("step", "val"):
        for step, values in expected[key].items():
            assert run[key][step] == pytest.approx(values, rel=rel), (key, step)


def test_fsdp2_and_accelerate_examples_on_1_2_3_processes_print_the_same_numbers() -> None:
    one = torchrun(1, [
        fsdp2(12, 13), fsdp2(12, 2, SMALL), fsdp2(12, 13, FP32),  # the references
        fsdp2(1, 1), accelerate(4, 5),
    ])  # fmt: skip
    two = torchrun(2, [
        fsdp2(2, 4, "--head logits"), fsdp2(3, 1, SMALL), fsdp2(6, 13, FP32),
        accelerate(1, 2), accelerate(2, 13, SMALL), accelerate(6, 3, FP32),
    ])  # fmt: skip
    three = torchrun(3, [fsdp2(1, 2), fsdp2(4, 1, SMALL)])
    reference, small, fp32 = one[:3]
    for run in (reference, small):
        for loss, perplexity in run["val"].values():
            assert perplexity == pytest.approx(math.exp(loss), rel=1e-9)
        assert run["val"][2][0] == pytest.approx(run["reference"], rel=FP64_REL)
        assert run["step"][1] != run["step"][2]
    for run in (one[3], one[4], two[0], two[3], three[0]):
        assert_same(run, reference, FP64_REL)
    for run in (two[1], two[4], three[1]):
        assert_same(run, small, FP64_REL)
    for run in (two[2], two[5]):
        assert_same(run, fp32, FP32_REL)
