"""The plain-loop examples under ``torchrun`` on CPU: any split of a step, the same numbers.

One launch per number of processes runs the example's ``train()`` for several configurations
(tests/helpers/example_runs.py). Every run of an example prints the training losses,
gradient norms and validation values of one process on the unsplit global batch
(``--micro-batch-size`` = ``--global-batch-size``, or k = 1) evaluating the whole
validation set as one batch; its last ``val_loss`` is Hugging Face's own ``outputs.loss`` of
the trained model over that set, and ``val_ppl = exp(val_loss)``. The first sequence of every
global batch scores nothing, so ``--micro-batch-size 1`` runs an empty micro-batch; a
validation set of 2 sequences on 3 ranks (1 on 2) leaves rank 0 without any.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
COMMON = "--steps 4 --val-every 2 --dtype float64 "
FP64, FP32 = 1e-9, 2e-5


def torchrun(nproc: int, example: str, runs: list[str]) -> list[dict[str, dict]]:
    """Per run: ``{"step": {S: (loss, grad_norm)}, "val": {S: (L, P)}, "reference": L}``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "tests.helpers.example_runs", example]
    result = subprocess.run(
        command + [COMMON + run for run in runs],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parsed = []
    for text in re.split(r"^run \d+$", result.stdout, flags=re.M)[1:]:
        number = r"(-?[\d.]+|nan)"
        train = re.findall(rf"^step (\d+) loss {number} grad_norm {number}$", text, re.M)
        val = re.findall(rf"^val step (\d+) val_loss {number} val_ppl {number}$", text, re.M)
        (reference,) = re.findall(rf"^reference val_loss {number}$", text, re.M)
        parsed.append({
            "step": {int(s): (float(a), float(b)) for s, a, b in train},
            "val": {int(s): (float(a), float(b)) for s, a, b in val},
            "reference": float(reference),
        })  # fmt: skip
    assert len(parsed) == len(runs), result.stdout[-3000:]
    return parsed


def assert_same(run: dict, expected: dict, rel: float) -> None:
    assert sorted(run["step"]) == [1, 2, 3, 4] and sorted(run["val"]) == [2, 4]
    for key in ("step", "val"):
        for step, values in expected[key].items():
            assert run[key][step] == pytest.approx(values, rel=rel), (key, step)


def assert_reference(run: dict) -> None:
    for loss, perplexity in run["val"].values():
        assert perplexity == pytest.approx(math.exp(loss), rel=1e-9)
    assert run["val"][4][0] == pytest.approx(run["reference"], rel=FP64)
    assert run["step"][1] != run["step"][4]


def fsdp2(micro: int, val_batch: int, more: str = "") -> str:
    return f"--micro-batch-size {micro} --val-batch-size {val_batch} {more}"


def accelerate(k: int, val_batch: int, more: str = "") -> str:
    return f"--gradient-accumulation-steps {k} --val-batch-size {val_batch} {more}"


def test_fsdp2_example_on_1_2_3_ranks_every_micro_batch_size() -> None:
    small, fp32 = "--val-size 2", "--dtype float32"
    one = torchrun(1, "torch_fsdp2_loop", [
        fsdp2(12, 13), fsdp2(12, 2, small), fsdp2(12, 13, fp32),
        fsdp2(1, 1), fsdp2(2, 5), fsdp2(3, 2), fsdp2(4, 13), fsdp2(6, 4),
    ])  # fmt: skip
    two = torchrun(2, "torch_fsdp2_loop", [
        fsdp2(1, 13), fsdp2(2, 4, "--head logits"), fsdp2(3, 1), fsdp2(6, 2),
        fsdp2(3, 1, small),
    ])  # fmt: skip
    three = torchrun(3, "torch_fsdp2_loop", [
        fsdp2(1, 2), fsdp2(2, 13), fsdp2(4, 3), fsdp2(4, 1, small), fsdp2(1, 2, fp32),
    ])  # fmt: skip
    for run in one[:2]:
        assert_reference(run)
    for run in [*one[3:], *two[:4], *three[:3]]:
        assert_same(run, one[0], FP64)
    for run in (two[4], three[3]):
        assert_same(run, one[1], FP64)
    assert_same(three[4], one[2], FP32)


def test_accelerate_example_on_1_2_processes_every_accumulation() -> None:
    small, fp32 = "--val-size 1", "--dtype float32"
    one = torchrun(1, "accelerate_loop", [
        accelerate(1, 13), accelerate(1, 1, small), accelerate(1, 13, fp32),
        accelerate(2, 3), accelerate(4, 1),
    ])  # fmt: skip
    two = torchrun(2, "accelerate_loop", [
        accelerate(1, 2), accelerate(2, 4), accelerate(4, 13), accelerate(2, 1, small),
        accelerate(4, 5, fp32),
    ])  # fmt: skip
    for run in one[:2]:
        assert_reference(run)
    for run in [*one[3:], *two[:3]]:
        assert_same(run, one[0], FP64)
    assert_same(two[3], one[1], FP64)
    assert_same(two[4], one[2], FP32)
