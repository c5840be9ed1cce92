"""``python train.py`` under faults, as a user meets them: nothing lost, nothing repeated.

With the default dropout (0.1), every interrupted run, resumed, ends with the uninterrupted
run's ``metrics.csv``, text-identical; the faults (``tests/helpers/faults.py``) follow one
another in one run directory, each run resuming what the previous one left.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from bert_reduce.recipe.run_directory import RunDirectory, RunDirectoryError
from tests.helpers.dist_utils import HANG_GUARD_S
from tests.helpers.recipe_runs import (
    CHECKPOINTED,
    checkpoint_names,
    rows,
    run_train_py,
    start_train_py,
    step_of,
    training_steps,
    wait_until,
)

pytestmark = pytest.mark.slow

# A fixed schedule of 40 steps: a run stopped or killed at any step has the rows of the
# uninterrupted run up to there.
LONG = [*CHECKPOINTED, "optim.scheduler.total_steps=40", "trainer.max_steps=40"]
TINY = [*CHECKPOINTED, "optim.scheduler.total_steps=12", "trainer.max_steps=12"]
UNLOCKED = shutil.ignore_patterns(".run.lock")  # a copy of a run, not of its lock
DDP = ("trainer.devices=2", "data.micro_batch_size=4")  # 2 gloo processes, 2 micro-batches each


def train(run_dir: Path, *overrides: str, tiny: list[str] = LONG, **kwargs):
    return run_train_py(*tiny, *overrides, f"hydra.run.dir={run_dir}", **kwargs)


def start(run_dir: Path, *overrides: str, tiny: list[str] = LONG):
    return start_train_py(*tiny, *overrides, f"hydra.run.dir={run_dir}")


def metrics(run_dir: Path) -> list[str]:
    return (run_dir / "metrics.csv").read_text().splitlines()


def in_place_names(checkpoints: Path) -> list[str]:
    """The checkpoints put in place: no temporary file of a write not yet committed."""
    return [name for name in checkpoint_names(checkpoints) if ".tmp-" not in name]


def checkpoints_up_to(step: int) -> list[str]:
    return ["last.ckpt", *(f"step{k:06d}.ckpt" for k in range(5, step + 1, 5))]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Every step once, and the reference's rows: the same text, so the same numbers too."""
    steps = training_steps(reference)
    assert training_steps(run_dir) == steps == list(range(1, len(steps) + 1))
    for key in ("train_loss", "val_ppl"):  # the numbers first, for a readable failure
        got = [float(row[key]) for row in rows(run_dir) if row[key]]
        assert got == pytest.approx([float(r[key]) for r in rows(reference) if r[key]], rel=1e-6)
    assert metrics(run_dir) == metrics(reference)


def assert_prefix_of(run_dir: Path, reference: Path) -> None:
    """The rows so far are the reference's first rows: nothing lost or repeated yet."""
    assert metrics(run_dir) == metrics(reference)[: len(metrics(run_dir))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(run_dir)
    assert training_steps(run_dir) == list(range(1, 41))
    assert checkpoint_names(run_dir / "checkpoints") == checkpoints_up_to(40)
    return run_dir


def stop_with(signum: int, process: subprocess.Popen[str], run_dir: Path, reference: Path) -> int:
    """Send ``signum`` to a running ``train.py``; check its stop, return the step it stopped at."""
    process.send_signal(signum)  # to the first process only: under DDP, the ranks agree
    output, _ = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 128 + signum, output[-3000:]
    stopped = re.search(rf"Stopped by {signal.Signals(signum).name} after step (\d+);", output)
    assert stopped, output[-3000:]
    assert_prefix_of(run_dir, reference)
    assert metrics(run_dir)[-1].split(",")[1] == stopped[1]  # logged up to the stop, no further
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == int(stopped[1])
    return int(stopped[1])


def test_end_of_run_checkpoint_then_signals_then_resume_give_the_uninterrupted_rows(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # 4 steps, before the first periodic checkpoint (5): Lightning's ModelCheckpoint would save
    # last.ckpt when training ends, recording the unfinished epoch as done.
    last = tmp_path / "checkpoints" / "last.ckpt"
    train(tmp_path, "trainer.max_steps=4")
    assert step_of(last) == 4
    process = start(tmp_path, f"resume={last}")
    lock = tmp_path / ".run.lock"
    wait_until(lambda: f"pid {process.pid} on host" in lock.read_text(), process)
    # What a second run into the directory meets first: the lock, naming the running one.
    held = rf"Another run is running in {re.escape(str(tmp_path))}: pid {process.pid} on host"
    with pytest.raises(RunDirectoryError, match=held), RunDirectory(tmp_path):
        pass
    wait_until((tmp_path / "checkpoints" / "step000005.ckpt").is_file, process)
    stopped = stop_with(signal.SIGTERM, process, tmp_path, uninterrupted)
    assert 5 <= stopped < 40
    process = start(tmp_path, f"resume={last}")
    wait_until(lambda: training_steps(tmp_path)[-1] > stopped, process)
    assert stop_with(signal.SIGINT, process, tmp_path, uninterrupted) < 40
    train(tmp_path, f"resume={last}")
    assert metrics(tmp_path) == metrics(uninterrupted)
    assert checkpoint_names(tmp_path / "checkpoints") == checkpoints_up_to(40)
    assert (tmp_path / "config.1.yaml").is_file()  # the first attempt's config, kept


def test_signal_on_two_processes_then_resume_gives_the_uninterrupted_rows(tmp_path: Path) -> None:
    # Dropout draws per rank: a 2-process run has its own rows, the reference of its resume.
    reference = tmp_path / "uninterrupted"
    train(reference, *DDP, tiny=TINY)
    run_dir = tmp_path / "stopped"
    process = start(run_dir, *DDP, tiny=TINY)
    wait_until((run_dir / "checkpoints" / "step000005.ckpt").is_file, process)
    assert 5 <= stop_with(signal.SIGTERM, process, run_dir, reference) < 12
    train(run_dir, *DDP, f"resume={run_dir / 'checkpoints/last.ckpt'}", tiny=TINY)
    assert metrics(run_dir) == metrics(reference)


def test_overwrite_replaces_a_used_directory(uninterrupted: Path, tmp_path: Path) -> None:
    # Without overwrite=true, refused and left byte-identical: tests/integration/test_bad_inputs.py.
    replaced = shutil.copytree(uninterrupted, tmp_path / "replaced")
    train(replaced, "trainer.max_steps=2", "overwrite=true")
    assert [line.split(",")[1] for line in metrics(replaced)[1:]] == ["1", "2", "2"]
    assert checkpoint_names(replaced / "checkpoints") == ["last.ckpt"]


def test_sigkill_then_the_same_command_finishes_the_run_once(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # resume=auto into an empty directory starts the run; SIGKILL once 12 steps are logged.
    process = start(tmp_path, "resume=auto")
    wait_until(lambda: len(training_steps(tmp_path)) >= 12, process)
    process.kill()
    output, _ = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == -signal.SIGKILL
    assert "resume=auto: resuming" not in output and "Removed" not in output
    assert 12 <= len(training_steps(tmp_path)) < 40
    last = tmp_path / "checkpoints" / "last.ckpt"
    os.truncate(last, 1000)
    result = train(tmp_path, "resume=auto")
    output = result.stdout + result.stderr
    resumed = re.search(r"resume=auto: resuming from (\S+) \(step (\d+)\)", output)
    assert resumed, output[-3000:]
    assert f"resume=auto: {last} does not load (not a readable PyTorch checkpoint" in output
    assert f"kept as last.ckpt.damaged. Resuming from {resumed[1]} (step" in output
    assert (tmp_path / "checkpoints" / "last.ckpt.damaged").stat().st_size == 1000
    assert Path(resumed[1]).name.startswith("step")
    assert_same_run(tmp_path, uninterrupted)


# Each run meets one fault; the next one is the same command (resume=auto), from what that
# fault left: (fault, checkpoints in place after it, last.ckpt's step, the last row's step,
# where the next run resumes). A step's checkpoints are in place only once its rows are.
CHAIN = [
    ("kill-after-checkpoint-write@10", checkpoints_up_to(5), 5, 9, "last.ckpt"),
    ("kill-after-train-row@10", checkpoints_up_to(5), 5, 10, "last.ckpt"),
    ("kill-mid-commit@10", checkpoints_up_to(10), 5, 10, "step000010.ckpt"),
    ("enospc@15", checkpoints_up_to(10), 5, 14, "step000010.ckpt"),
    ("kill-after-commit@20", checkpoints_up_to(20), 20, 20, "last.ckpt"),
    # keep_last=1 deletes the older ones only once step 25's last.ckpt is in place.
    ("kill-mid-commit@25", checkpoints_up_to(25), 20, 25, "step000025.ckpt"),
]


def test_kill_around_a_checkpoint_loses_and_repeats_no_row(
    uninterrupted: Path, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    resumed_from = None
    for fault, in_place, last_step, last_row, resumes_from in CHAIN:
        options = ["resume=auto"]
        if fault.endswith("@25"):
            options.append("callbacks.checkpoint.keep_last=1")
        result = train(tmp_path, *options, fault=fault, check=False)
        output = result.stdout + result.stderr
        if resumed_from is not None:
            assert f"resume=auto: resuming from {checkpoints / resumed_from}" in output, fault
        if fault.startswith("enospc"):
            assert result.returncode == 1, output[-3000:]
            path = checkpoints / "step000015.ckpt"
            assert (
                f"OSError: [Errno 28] Could not write the checkpoint {path} (step 15): No space "
                "left on device." in result.stderr
            ), result.stderr[-3000:]
            assert checkpoint_names(checkpoints) == in_place  # no partial file
        else:
            assert result.returncode == -signal.SIGKILL, (fault, output[-3000:])
            assert in_place_names(checkpoints) == in_place
        assert step_of(checkpoints / "last.ckpt") == last_step, fault
        assert training_steps(tmp_path)[-1] == last_row, fault
        assert_prefix_of(tmp_path, uninterrupted)
        resumed_from = resumes_from
    result = train(tmp_path, "resume=auto", "callbacks.checkpoint.keep_last=1")
    assert f"resume=auto: resuming from {checkpoints / resumed_from}" in result.stdout
    assert_same_run(tmp_path, uninterrupted)
    assert checkpoint_names(checkpoints) == ["last.ckpt", "step000040.ckpt"]


def test_resume_from_an_earlier_checkpoint_then_kill_then_auto(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # Continue a finished run from its step 5 in its own directory: last.ckpt (40) and steps
    # 10 to 40 are of the continuation this run replaces, so they are moved aside; a kill
    # after step 10's checkpoint is written (not yet in place) and resume=auto must then go on
    # from step 5, not from the old last.ckpt (that would leave steps 10 to 40 without rows).
    shutil.copytree(uninterrupted, tmp_path, ignore=UNLOCKED, dirs_exist_ok=True)
    step5 = tmp_path / "checkpoints" / "step000005.ckpt"
    killed = train(tmp_path, f"resume={step5}", fault="kill-after-checkpoint-write@10", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "is after step 5, which this run resumes from and trains again" in killed.stdout
    superseded = [f"{name}.superseded" for name in checkpoints_up_to(40) if name != step5.name]
    assert in_place_names(step5.parent) == sorted([step5.name, *superseded])
    result = train(tmp_path, "resume=auto")
    assert f"resume=auto: resuming from {step5} (step 5)" in result.stdout
    assert_same_run(tmp_path, uninterrupted)
