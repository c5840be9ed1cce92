"""Compose ``conf/`` as ``train.py`` does; run it as a user does, read its rows and checkpoints."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from bert_reduce.recipe.config import register_configs
from bert_reduce.recipe.run_directory import DATAMODULE_STATE_KEY
from tests.helpers.dist_utils import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
_SMALL = [
    "data.global_batch_size=16",
    "data.num_train_sequences=80",  # 5 steps per epoch
    "data.num_val_sequences=37",  # prime: divides no micro-batch size nor 2 ranks
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "plot=false",
]
# data.max_length=512: lengths vary, micro-batches and ranks pad differently.
TINY = [*_SMALL, "model.dropout=0.0", "data.max_length=512"]
# The default model (dropout 0.1), validation every 4 steps and a checkpoint every 5 (12 steps
# cross two epoch boundaries): the runs that are killed and resumed (test_fault_tolerance.py,
# test_slurm_requeue_example.py)
CHECKPOINTED = [
    *_SMALL,
    "trainer.val_check_interval=4",
    "callbacks.checkpoint.every_n_train_steps=5",
    "trainer.enable_model_summary=false",
    "tensorboard=false",
]
# A warning as Python prints it ("file.py:12: UserWarning: ..." or, for Lightning's own,
# "file.py:12: message"), and Lightning's advertisements.
WARNING = re.compile(r"\.py:\d+: |Warning: |💡")
# Every Python warning shown (deprecations too), and no network: a run must print none.
WARNINGS_SHOWN = {"PYTHONWARNINGS": "default", "HF_HUB_OFFLINE": "1"}


register_configs()


def compose_config(*overrides: str) -> DictConfig:
    """The config ``python train.py *overrides`` composes (Hydra's compose API)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT)}


def run_train_py(
    *args: str, env: Mapping[str, str] | None = None, fault: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """``python train.py *args`` on one thread (``fault``: under ``tests/helpers/faults.py``).

    With ``check``, the test fails, showing the output, unless the run succeeds.
    """
    result = subprocess.run(
        [sys.executable, *(["-m", "tests.helpers.faults"] if fault else ["train.py"]), *args],
        cwd=ROOT,
        env={**ENV, **(env or {}), **({"TEST_FAULT": fault} if fault else {})},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert not check or result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def start_train_py(*args: str) -> subprocess.Popen[str]:
    """``python train.py *args`` started, its output (stdout and stderr) in one pipe."""
    return subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_until(done: Callable[[], bool], process: subprocess.Popen[str]) -> None:
    """Poll ``done()`` while ``process`` runs; the test fails if it ends or hangs first."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def train(run_dir: Path, *overrides: str, multirun: bool = False) -> list[Path]:
    """A ``TINY`` run (or a Hydra multirun) into ``run_dir``, printing no warning with
    ``WARNINGS_SHOWN``; the run directories it wrote (a multirun's: one per job)."""
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    multi = ["-m"] if multirun else []
    assert_no_warning(run_train_py(*multi, *TINY, *overrides, where, env=WARNINGS_SHOWN))
    return [job for job in run_dir.iterdir() if job.name.isdigit()] if multirun else [run_dir]


def assert_no_warning(result: subprocess.CompletedProcess) -> None:
    """The run printed no line that is a warning (see ``WARNING``)."""
    lines = (result.stdout + result.stderr).replace("\r", "\n").splitlines()
    printed = [line for line in lines if WARNING.search(line)]
    assert not printed, "\n".join(printed)


def rows(run_dir: Path) -> list[dict[str, str]]:
    if not (run_dir / "metrics.csv").is_file():
        return []
    with open(run_dir / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def training_steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in rows(run_dir) if r["train_loss"]]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["train_loss"]) for r in rows(run_dir) if r["train_loss"]}


def validations(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {
        int(r["step"]): (float(r["val_loss"]), float(r["val_ppl"]))
        for r in rows(run_dir)
        if r["val_ppl"]
    }


def assert_same_rows(run_dir: Path, reference: Path, steps: list[int]) -> None:
    """``run_dir`` logged the ``train_loss`` of ``steps`` and the last validation of
    ``reference`` (``val_loss``, ``val_ppl``), relative 1e-5."""
    losses, expected = train_losses(run_dir), train_losses(reference)
    # The reference validated once, at the end, and its loss moved: equal is not trivial.
    assert sorted(validations(reference)) == [steps[-1]], reference
    assert expected[steps[0]] != expected[steps[-1]], reference
    assert sorted(losses) == steps, run_dir
    for step in steps:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), (run_dir, step)
    last = max(validations(reference))
    assert validations(run_dir)[last] == pytest.approx(validations(reference)[last], rel=1e-5)


def checkpoint_names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=True, mmap=True)["global_step"]


def recipe_checkpoint(path: Path, global_batch_size: int = 16, step: int = 7) -> Path:
    """A file in the format of a ``train.py`` checkpoint, as far as resuming first reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {DATAMODULE_STATE_KEY: {"global_batch_size": global_batch_size}, "global_step": step}
    torch.save(state, path)
    return path
