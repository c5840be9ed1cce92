"""Run ``python train.py`` as a user does (a subprocess from the repository root), read its rows.

For the end-to-end recipe tests (tests/recipe/test_train_e2e.py, test_train_hf_esm_e2e.py,
test_fault_tolerance.py, tests/integration/test_slurm_requeue_example.py).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.helpers.dist_utils import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
NUM_VAL = 37  # prime: divides no micro-batch size nor 2 ranks
TINY = [
    "model.dropout=0.0",
    "data.global_batch_size=16",
    "data.num_train_sequences=80",
    f"data.num_val_sequences={NUM_VAL}",
    "data.max_length=512",  # lengths vary: micro-batches and ranks pad differently
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "plot=false",
]
CHECKPOINTED = [  # the default model (dropout 0.1), tiny data, validation every 4 steps and a
    # checkpoint every 5: the runs that are killed and resumed (test_fault_tolerance.py,
    # test_slurm_requeue_example.py)
    "data.global_batch_size=16",
    "data.num_train_sequences=80",  # 5 steps per epoch: 12 steps cross two epoch boundaries
    f"data.num_val_sequences={NUM_VAL}",
    "trainer.val_check_interval=4",
    "callbacks.checkpoint.every_n_train_steps=5",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "tensorboard=false",
    "plot=false",
]
# A warning as Python prints it ("file.py:12: UserWarning: ..." or, for Lightning's own,
# "file.py:12: message"), and Lightning's advertisements.
WARNING = re.compile(r"\.py:\d+: |Warning: |💡")


def run_train_py(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python train.py *args`` on one thread; the test fails, showing its output, if it does."""
    result = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train(run_dir: Path, *overrides: str, multirun: bool = False) -> subprocess.CompletedProcess:
    """A ``TINY`` run (or a Hydra multirun) into ``run_dir``."""
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    return run_train_py(*(["-m"] if multirun else []), *TINY, *overrides, where)


def warnings_printed(result: subprocess.CompletedProcess) -> list[str]:
    """The lines of a run's output that are warnings (see ``WARNING``)."""
    lines = (result.stdout + result.stderr).replace("\r", "\n").splitlines()
    return [line for line in lines if WARNING.search(line)]


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def train_losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["train_loss"]) for r in rows(run_dir) if r["train_loss"]}


def validations(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {
        int(r["step"]): (float(r["val_loss"]), float(r["val_ppl"]))
        for r in rows(run_dir)
        if r["val_ppl"]
    }
