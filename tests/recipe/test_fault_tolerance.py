"""``python train.py`` under faults, as a user meets them: nothing lost, nothing repeated.

With the DEFAULT config's dropout (0.1), so that resuming must restore every generator:

* ``SIGTERM`` or ``SIGINT`` mid-run, on one process or two (the signal sent to the first only):
  the run stops after the current step with ``last.ckpt`` and exit status ``128 + signal``;
  resuming into the same directory completes ``metrics.csv`` to the very rows (same text) of an
  uninterrupted run of the same layout: one row per step, no gap, no repeat;
* ``SIGKILL`` at whatever instant the run has reached 12 logged steps (of 40), then the same
  command again (``resume=auto``): the same rows as the uninterrupted run; also when the newest
  ``last.ckpt`` is then cut to 1000 bytes (it is moved aside, named, and an intact checkpoint
  used instead);
* ``SIGKILL`` injected at each instant around a checkpoint (after it is written and before its
  row, after its row, between its files being put in place, after), and a disk that fills
  while a checkpoint is written (an error naming the file and the cause): the same command
  again gives the uninterrupted rows; ``keep_last`` never deletes the checkpoint a resume needs;
* the ``last.ckpt`` written at the end of a run whose ``max_steps`` (4) is not a multiple of
  the checkpoint interval (5), resumed into the same directory to more steps: the same;
* a second run into a used directory fails and leaves every file byte-identical, also when its
  ``resume=`` checkpoint is missing or corrupt; ``overwrite=true`` replaces the run;
* a run into a directory where a run is running fails naming the running process.

The faults are injected by ``tests/helpers/faults.py`` (the library has no fault hooks).
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.dist_utils import HANG_GUARD_S
from tests.helpers.recipe_runs import CHECKPOINTED

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = [*CHECKPOINTED, "optim.scheduler.total_steps=12"]  # a fixed schedule of 12 steps
LONG = [*CHECKPOINTED, "optim.scheduler.total_steps=40", "trainer.max_steps=40"]  # killed after 12+
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT)}


def command(run_dir: Path, *overrides: str, tiny: list[str] = TINY) -> list[str]:
    return [sys.executable, "train.py", *tiny, *overrides, f"hydra.run.dir={run_dir}"]


def train(
    run_dir: Path, *overrides: str, tiny: list[str] = TINY
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(run_dir, *overrides, tiny=tiny),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def train_ok(run_dir: Path, *overrides: str) -> None:
    result = train(run_dir, *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def wait_for(path: Path, process: subprocess.Popen[str], timeout: float = HANG_GUARD_S) -> None:
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
    output, _ = process.communicate(timeout=HANG_GUARD_S)
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
        process.wait(timeout=HANG_GUARD_S)
    assert process.returncode == 128 + signal.SIGTERM


def training_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row["train_loss"]]


def checkpoint_files(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


def assert_same_run(run_dir: Path, reference: Path) -> str:
    """Every step once, and the reference's rows: the same text, so the same numbers too.

    Returns:
        The comparison in words, for the test's output.
    """
    steps = training_steps(reference)
    assert training_steps(run_dir) == steps == list(range(1, len(steps) + 1))
    with open(run_dir / "metrics.csv") as ours, open(reference / "metrics.csv") as theirs:
        rows, expected = list(csv.DictReader(ours)), list(csv.DictReader(theirs))
    worst = {}
    for key in ("train_loss", "val_ppl"):  # what the issue asks, at rtol 1e-6
        got = [float(row[key]) for row in rows if row[key]]
        want = [float(row[key]) for row in expected if row[key]]
        assert got == pytest.approx(want, rel=1e-6, abs=0), key
        worst[key] = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert metrics(run_dir) == metrics(reference)
    return (
        f"steps 1..{len(steps)} once; largest relative difference train_loss "
        f"{worst['train_loss']:.1e}, val_ppl {worst['val_ppl']:.1e}; final val_ppl "
        f"{[row['val_ppl'] for row in rows if row['val_ppl']][-1]} (reference "
        f"{[row['val_ppl'] for row in expected if row['val_ppl']][-1]})"
    )


@pytest.fixture(scope="module")
def uninterrupted_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted_long")
    result = train(run_dir, tiny=LONG)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("damage", [False, True], ids=["sigkill", "sigkill-then-last-ckpt-cut"])
def test_sigkill_then_the_same_command_finishes_the_run_once(
    uninterrupted_long: Path, tmp_path: Path, damage: bool
) -> None:
    # resume=auto into an empty directory starts the run; SIGKILL once 12 steps are logged.
    process = subprocess.Popen(
        command(tmp_path, "resume=auto", tiny=LONG),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while not ((tmp_path / "metrics.csv").is_file() and len(training_steps(tmp_path)) >= 12):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.kill()
    output, _ = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == -signal.SIGKILL
    assert "resume=auto: resuming" not in output and "Removed" not in output
    killed_at = len(training_steps(tmp_path))
    assert 12 <= killed_at < 40, killed_at
    last = tmp_path / "checkpoints" / "last.ckpt"
    if damage:
        os.truncate(last, 1000)
    result = train(tmp_path, "resume=auto", tiny=LONG)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    resumed = re.search(r"resume=auto: resuming from (\S+) \(step (\d+)\)", output)
    assert resumed, output[-3000:]
    if damage:
        assert f"resume=auto: {last} does not load (not a readable PyTorch checkpoint" in output
        assert f"kept as last.ckpt.damaged. Resuming from {resumed[1]} (step" in output
        assert (tmp_path / "checkpoints" / "last.ckpt.damaged").stat().st_size == 1000
        assert Path(resumed[1]).name.startswith("step")
    else:
        assert resumed[1] == str(last)
    same = assert_same_run(tmp_path, uninterrupted_long)
    print(f"\nkilled after {killed_at} logged steps, resumed from step {resumed[2]}: {same}")


UP_TO_5 = ["last.ckpt", "step000005.ckpt"]
UP_TO_10 = ["last.ckpt", "step000005.ckpt", "step000010.ckpt"]


@pytest.mark.parametrize(
    ("fault", "keep_last", "left_in_place"),
    [
        ("kill-after-checkpoint-write", None, UP_TO_5),
        ("kill-after-train-row", None, UP_TO_5),
        ("kill-mid-commit", None, UP_TO_10),
        ("kill-after-commit", None, UP_TO_10),
        # keep_last=1 deletes step 5 only once step 10's last.ckpt is in place.
        ("kill-mid-commit", 1, UP_TO_10),
    ],
    ids=["after-write", "after-row", "mid-commit", "after-commit", "mid-commit-keep-last-1"],
)
def test_kill_around_a_checkpoint_loses_and_repeats_no_row(
    uninterrupted: Path, tmp_path: Path, fault: str, keep_last: int | None, left_in_place: list
) -> None:
    extra = () if keep_last is None else (f"callbacks.checkpoint.keep_last={keep_last}",)
    killed = subprocess.run(
        [sys.executable, "-m", "tests.helpers.faults", *TINY, "trainer.max_steps=12",
         "resume=auto", *extra, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env={**ENV, "TEST_FAULT": f"{fault}@10"}, capture_output=True, text=True,
        timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    in_place = [name for name in checkpoint_files(tmp_path) if ".tmp-" not in name]
    assert in_place == left_in_place
    # Step 10's checkpoint is in place only once its row is: between the two, a kill leaves
    # the rows up to 9 (or 10) and last.ckpt at step 5.
    last_step = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    assert last_step["global_step"] == (10 if fault == "kill-after-commit" else 5)
    assert training_steps(tmp_path)[-1] == (9 if fault == "kill-after-checkpoint-write" else 10)
    result = train(tmp_path, "trainer.max_steps=12", "resume=auto", *extra)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_run(tmp_path, uninterrupted)
    kept = ["last.ckpt", "step000010.ckpt"] if keep_last else UP_TO_10
    assert checkpoint_files(tmp_path) == kept


def test_disk_full_during_a_checkpoint_leaves_the_run_resumable(
    uninterrupted: Path, tmp_path: Path
) -> None:
    failed = subprocess.run(
        [sys.executable, "-m", "tests.helpers.faults", *TINY, "trainer.max_steps=12",
         "resume=auto", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env={**ENV, "TEST_FAULT": "enospc@10"}, capture_output=True, text=True,
        timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    path = tmp_path / "checkpoints" / "step000010.ckpt"
    assert (
        f"OSError: [Errno 28] Could not write the checkpoint {path} (step 10): No space left on "
        "device." in failed.stderr
    ), failed.stderr[-3000:]
    # The previous checkpoints and metrics.csv as they were: no partial file, rows up to 9.
    assert checkpoint_files(tmp_path) == ["last.ckpt", "step000005.ckpt"]
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    assert last["global_step"] == 5
    assert metrics(tmp_path) == metrics(uninterrupted)[: len(metrics(tmp_path))]
    assert training_steps(tmp_path)[-1] == 9
    train_ok(tmp_path, "trainer.max_steps=12", "resume=auto")
    assert_same_run(tmp_path, uninterrupted)


def test_resume_from_an_earlier_checkpoint_then_kill_then_auto(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # Continue a finished 12-step run from its step 5 in its own directory: last.ckpt (12) and
    # step 10 are of the continuation this run replaces, so they are moved aside; a kill
    # after step 10's checkpoint is written (not yet in place) and resume=auto must then go on
    # from step 5, not from the old last.ckpt (that would leave steps 10 to 12 without rows).
    for path in uninterrupted.rglob("*"):
        if path.is_file() and path.name != ".run.lock":
            (tmp_path / path.relative_to(uninterrupted)).parent.mkdir(exist_ok=True)
            (tmp_path / path.relative_to(uninterrupted)).write_bytes(path.read_bytes())
    step5 = tmp_path / "checkpoints" / "step000005.ckpt"
    killed = subprocess.run(
        [sys.executable, "-m", "tests.helpers.faults", *TINY, "trainer.max_steps=12",
         f"resume={step5}", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env={**ENV, "TEST_FAULT": "kill-after-checkpoint-write@10"},
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "is after step 5, which this run resumes from and trains again" in killed.stdout
    in_place = [name for name in checkpoint_files(tmp_path) if ".tmp-" not in name]
    assert in_place == ["last.ckpt.superseded", "step000005.ckpt", "step000010.ckpt.superseded"]
    result = train(tmp_path, "trainer.max_steps=12", "resume=auto")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resume=auto: resuming from {step5} (step 5)" in result.stdout
    assert_same_run(tmp_path, uninterrupted)
