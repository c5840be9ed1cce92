"""``python train.py`` under faults, as a user meets them: nothing lost, nothing repeated.

With the DEFAULT config's dropout (0.1), so that resuming must restore every generator:

* ``SIGTERM`` or ``SIGINT`` mid-run, on one process or two (the signal sent to the first only):
  the run stops after the current step with ``last.ckpt`` and exit status ``128 + signal``;
  resuming into the same directory completes ``metrics.csv`` to the very rows (same text) of an
  uninterrupted run of the same layout: one row per step, no gap, no repeat;
* the ``last.ckpt`` written at the end of a run whose ``max_steps`` (4) is not a multiple of
  the checkpoint interval (5), resumed into the same directory to more steps: the same;
* a second run into a used directory fails and leaves every file byte-identical, also when its
  ``resume=`` checkpoint is missing or corrupt; ``overwrite=true`` replaces the run;
* a run into a directory where a run is running fails naming the running process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = [  # the default model (dropout 0.1), tiny data, a fixed schedule of 12 steps
    "data.global_batch_size=16",
    "data.num_train_sequences=80",  # 5 steps per epoch: 12 steps cross two epoch boundaries
    "data.num_val_sequences=37",
    "optim.scheduler.total_steps=12",
    "trainer.val_check_interval=4",
    "callbacks.checkpoint.every_n_train_steps=5",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "tensorboard=false",
    "plot=false",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "train.py", *TINY, *overrides, f"hydra.run.dir={run_dir}"]


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(run_dir, *overrides), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )


def train_ok(run_dir: Path, *overrides: str) -> None:
    result = train(run_dir, *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def wait_for(path: Path, process: subprocess.Popen[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.stat().st_size > 0):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


DDP = ("trainer.devices=2", "data.micro_batch_size=4")  # 2 gloo processes, 2 micro-batches each


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train_ok(run_dir, "trainer.max_steps=12")
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Dropout draws per rank: a 2-process run has its own rows, the reference of its resume.
    run_dir = tmp_path_factory.mktemp("uninterrupted_ddp")
    train_ok(run_dir, "trainer.max_steps=12", *DDP)
    return run_dir


def metrics(run_dir: Path) -> list[str]:
    return (run_dir / "metrics.csv").read_text().splitlines()


def test_uninterrupted_run_has_one_row_per_step(uninterrupted: Path) -> None:
    lines = metrics(uninterrupted)
    steps = [line.split(",")[1] for line in lines[1:] if line.split(",")[0]]  # training rows
    assert steps == [str(step) for step in range(1, 13)]
    assert sorted((uninterrupted / "checkpoints").iterdir()) == [
        uninterrupted / "checkpoints" / name
        for name in ("last.ckpt", "step000005.ckpt", "step000010.ckpt")
    ]


@pytest.mark.parametrize(
    ("signum", "layout"),
    [(signal.SIGTERM, ()), (signal.SIGINT, ()), (signal.SIGTERM, DDP)],
    ids=["SIGTERM", "SIGINT", "SIGTERM-2-processes"],
)
def test_signal_then_resume_gives_the_uninterrupted_rows(
    request: pytest.FixtureRequest, signum: int, layout: tuple[str, ...], tmp_path: Path
) -> None:
    uninterrupted = request.getfixturevalue("uninterrupted_ddp" if layout else "uninterrupted")
    process = subprocess.Popen(
        command(tmp_path, "trainer.max_steps=12", *layout),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(tmp_path / "checkpoints" / "step000005.ckpt", process)
    process.send_signal(signum)  # to the first process only: under DDP, the ranks agree
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 128 + signum, output[-3000:]
    name = signal.Signals(signum).name
    stopped = next(line for line in output.splitlines() if line.startswith(f"Stopped by {name}"))
    step = int(stopped.split("after step ")[1].split(";")[0])
    assert 5 <= step < 12, stopped
    assert metrics(tmp_path) == metrics(uninterrupted)[: len(metrics(tmp_path))]
    assert metrics(tmp_path)[-1].split(",")[1] == str(step)  # logged up to the stop, no further
    last = tmp_path / "checkpoints" / "last.ckpt"
    train_ok(tmp_path, "trainer.max_steps=12", *layout, f"resume={last}")
    assert metrics(tmp_path) == metrics(uninterrupted)


def test_resume_from_end_of_run_last_ckpt_into_the_same_directory(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # 4 steps, before the first periodic checkpoint (5): Lightning's ModelCheckpoint saves
    # last.ckpt when training ends, recording the unfinished epoch as done.
    train_ok(tmp_path, "trainer.max_steps=4")
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    assert last["global_step"] == 4
    train_ok(tmp_path, "trainer.max_steps=12", f"resume={tmp_path / 'checkpoints' / 'last.ckpt'}")
    assert metrics(tmp_path) == metrics(uninterrupted)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "last.ckpt", "step000005.ckpt", "step000010.ckpt",
    ]  # fmt: skip
    assert (tmp_path / "config.1.yaml").is_file()  # the first attempt's config, kept


def test_second_run_into_a_used_directory_changes_nothing(
    uninterrupted: Path, tmp_path: Path
) -> None:
    before = snapshot(uninterrupted)
    # A corrupt resume checkpoint fails the same way: tests/integration/test_bad_inputs.py.
    for overrides, error in [
        ((), "already holds a run"),
        ((f"resume={uninterrupted / 'checkpoints' / 'lats.ckpt'}",), "no such checkpoint file"),
    ]:
        result = train(uninterrupted, "trainer.max_steps=2", *overrides)
        assert result.returncode != 0 and error in result.stderr, result.stderr[-3000:]
        assert snapshot(uninterrupted) == before
    replaced = tmp_path / "replaced"
    replaced.mkdir()
    for name, content in before.items():
        (replaced / name).parent.mkdir(parents=True, exist_ok=True)
        (replaced / name).write_bytes(content)
    train_ok(replaced, "trainer.max_steps=2", "overwrite=true")
    assert [line.split(",")[1] for line in metrics(replaced)[1:]] == ["1", "2", "2"]
    assert sorted(p.name for p in (replaced / "checkpoints").iterdir()) == ["last.ckpt"]


def test_run_into_a_directory_in_use_names_the_running_process(tmp_path: Path) -> None:
    process = subprocess.Popen(
        command(tmp_path, "trainer.max_steps=400"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for(tmp_path / ".run.lock", process)
        result = train(tmp_path, "trainer.max_steps=2")
        assert result.returncode != 0
        assert f"Another run is running in {tmp_path}: pid {process.pid} on host" in result.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=240)
    assert process.returncode == 128 + signal.SIGTERM
