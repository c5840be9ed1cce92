"""``python train.py`` under faults, as a user meets them: nothing lost, nothing repeated.

With the default config's dropout (0.1), so that resuming must restore every generator, each
interrupted run, resumed, ends with the ``metrics.csv`` of the uninterrupted run, text-identical
(one row per step, no gap, no repeat):

* ``SIGTERM`` or ``SIGINT`` mid-run, on one process or two (sent to the first only): the run
  stops after the current step with ``last.ckpt`` and exit status ``128 + signal``;
* ``SIGKILL`` once 12 of 40 steps are logged, then the same command (``resume=auto``), also
  with that ``last.ckpt`` then cut to 1000 bytes (moved aside, named, an intact one used);
* ``SIGKILL`` at each instant around a checkpoint (``tests/helpers/faults.py``), with
  ``keep_last``, and a disk that fills while a checkpoint is written (an error naming the file
  and the cause);
* an end-of-run ``last.ckpt`` (4 steps, checkpoints every 5) resumed to more steps, and a run
  resumed from an earlier checkpoint of its own directory, then killed;
* a second run into a used or locked directory fails and leaves every file byte-identical;
  ``overwrite=true`` replaces the run.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.dist_utils import HANG_GUARD_S
from tests.helpers.recipe_runs import (
    CHECKPOINTED,
    rows,
    run_train_py,
    start_train_py,
    training_steps,
    wait_until,
)

pytestmark = pytest.mark.slow

TINY = [*CHECKPOINTED, "optim.scheduler.total_steps=12"]  # a fixed schedule of 12 steps
LONG = [*CHECKPOINTED, "optim.scheduler.total_steps=40", "trainer.max_steps=40"]
DDP = ("trainer.devices=2", "data.micro_batch_size=4")  # 2 gloo processes, 2 micro-batches each


def train(run_dir: Path, *overrides: str, tiny: list[str] = TINY, **kwargs):
    return run_train_py(*tiny, *overrides, f"hydra.run.dir={run_dir}", **kwargs)


def start(run_dir: Path, *overrides: str, tiny: list[str] = TINY):
    return start_train_py(*tiny, *overrides, f"hydra.run.dir={run_dir}")


def metrics(run_dir: Path) -> list[str]:
    return (run_dir / "metrics.csv").read_text().splitlines()


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def checkpoint_files(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=True, mmap=True)["global_step"]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Every step once, and the reference's rows: the same text, so the same numbers too."""
    steps = training_steps(reference)
    assert training_steps(run_dir) == steps == list(range(1, len(steps) + 1))
    for key in ("train_loss", "val_ppl"):  # the numbers first, for a readable failure
        got = [float(row[key]) for row in rows(run_dir) if row[key]]
        assert got == pytest.approx([float(r[key]) for r in rows(reference) if r[key]], rel=1e-6)
    assert metrics(run_dir) == metrics(reference)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(run_dir, "trainer.max_steps=12")
    assert training_steps(run_dir) == list(range(1, 13))
    assert checkpoint_files(run_dir) == ["last.ckpt", "step000005.ckpt", "step000010.ckpt"]
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Dropout draws per rank: a 2-process run has its own rows, the reference of its resume.
    run_dir = tmp_path_factory.mktemp("uninterrupted_ddp")
    train(run_dir, "trainer.max_steps=12", *DDP)
    return run_dir


@pytest.mark.parametrize(
    ("signum", "layout"),
    [(signal.SIGTERM, ()), (signal.SIGINT, ()), (signal.SIGTERM, DDP)],
    ids=["SIGTERM", "SIGINT", "SIGTERM-2-processes"],
)
def test_signal_then_resume_gives_the_uninterrupted_rows(
    request: pytest.FixtureRequest, signum: int, layout: tuple[str, ...], tmp_path: Path
) -> None:
    uninterrupted = request.getfixturevalue("uninterrupted_ddp" if layout else "uninterrupted")
    process = start(tmp_path, "trainer.max_steps=12", *layout)
    wait_until((tmp_path / "checkpoints" / "step000005.ckpt").is_file, process)
    process.send_signal(signum)  # to the first process only: under DDP, the ranks agree
    output, _ = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 128 + signum, output[-3000:]
    stopped = re.search(rf"Stopped by {signal.Signals(signum).name} after step (\d+);", output)
    assert stopped and 5 <= int(stopped[1]) < 12, output[-3000:]
    assert metrics(tmp_path) == metrics(uninterrupted)[: len(metrics(tmp_path))]
    assert metrics(tmp_path)[-1].split(",")[1] == stopped[1]  # logged up to the stop, no further
    train(tmp_path, "trainer.max_steps=12", *layout, f"resume={tmp_path / 'checkpoints/last.ckpt'}")
    assert metrics(tmp_path) == metrics(uninterrupted)


def test_resume_from_end_of_run_last_ckpt_into_the_same_directory(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # 4 steps, before the first periodic checkpoint (5): Lightning's ModelCheckpoint would save
    # last.ckpt when training ends, recording the unfinished epoch as done.
    train(tmp_path, "trainer.max_steps=4")
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 4
    train(tmp_path, "trainer.max_steps=12", f"resume={tmp_path / 'checkpoints' / 'last.ckpt'}")
    assert metrics(tmp_path) == metrics(uninterrupted)
    assert checkpoint_files(tmp_path) == ["last.ckpt", "step000005.ckpt", "step000010.ckpt"]
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
        result = train(uninterrupted, "trainer.max_steps=2", *overrides, check=False)
        assert result.returncode != 0 and error in result.stderr, result.stderr[-3000:]
        assert snapshot(uninterrupted) == before
    replaced = tmp_path / "replaced"
    for name, content in before.items():
        (replaced / name).parent.mkdir(parents=True, exist_ok=True)
        (replaced / name).write_bytes(content)
    train(replaced, "trainer.max_steps=2", "overwrite=true")
    assert [line.split(",")[1] for line in metrics(replaced)[1:]] == ["1", "2", "2"]
    assert checkpoint_files(replaced) == ["last.ckpt"]


def test_run_into_a_directory_in_use_names_the_running_process(tmp_path: Path) -> None:
    process = start(tmp_path, "trainer.max_steps=400")
    try:
        lock = tmp_path / ".run.lock"
        wait_until(lambda: lock.is_file() and lock.stat().st_size > 0, process)
        result = train(tmp_path, "trainer.max_steps=2", check=False)
        assert result.returncode != 0
        assert f"Another run is running in {tmp_path}: pid {process.pid} on host" in result.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 128 + signal.SIGTERM


@pytest.fixture(scope="module")
def uninterrupted_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted_long")
    train(run_dir, tiny=LONG)
    return run_dir


@pytest.mark.parametrize("damage", [False, True], ids=["sigkill", "sigkill-then-last-ckpt-cut"])
def test_sigkill_then_the_same_command_finishes_the_run_once(
    uninterrupted_long: Path, tmp_path: Path, damage: bool
) -> None:
    # resume=auto into an empty directory starts the run; SIGKILL once 12 steps are logged.
    process = start(tmp_path, "resume=auto", tiny=LONG)
    wait_until(lambda: len(training_steps(tmp_path)) >= 12, process)
    process.kill()
    output, _ = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == -signal.SIGKILL
    assert "resume=auto: resuming" not in output and "Removed" not in output
    assert 12 <= len(training_steps(tmp_path)) < 40
    last = tmp_path / "checkpoints" / "last.ckpt"
    if damage:
        os.truncate(last, 1000)
    result = train(tmp_path, "resume=auto", tiny=LONG)
    output = result.stdout + result.stderr
    resumed = re.search(r"resume=auto: resuming from (\S+) \(step (\d+)\)", output)
    assert resumed, output[-3000:]
    if damage:
        assert f"resume=auto: {last} does not load (not a readable PyTorch checkpoint" in output
        assert f"kept as last.ckpt.damaged. Resuming from {resumed[1]} (step" in output
        assert (tmp_path / "checkpoints" / "last.ckpt.damaged").stat().st_size == 1000
        assert Path(resumed[1]).name.startswith("step")
    else:
        assert resumed[1] == str(last)
    assert_same_run(tmp_path, uninterrupted_long)


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
    options = ["trainer.max_steps=12", "resume=auto"]
    if keep_last is not None:
        options.append(f"callbacks.checkpoint.keep_last={keep_last}")
    killed = train(tmp_path, *options, fault=f"{fault}@10", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert [name for name in checkpoint_files(tmp_path) if ".tmp-" not in name] == left_in_place
    # Step 10's checkpoint is in place only once its row is: between the two, a kill leaves
    # the rows up to 9 (or 10) and last.ckpt at step 5.
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == (
        10 if fault == "kill-after-commit" else 5
    )
    assert training_steps(tmp_path)[-1] == (9 if fault == "kill-after-checkpoint-write" else 10)
    train(tmp_path, *options)
    assert_same_run(tmp_path, uninterrupted)
    kept = ["last.ckpt", "step000010.ckpt"] if keep_last else UP_TO_10
    assert checkpoint_files(tmp_path) == kept


def test_disk_full_during_a_checkpoint_leaves_the_run_resumable(
    uninterrupted: Path, tmp_path: Path
) -> None:
    options = ["trainer.max_steps=12", "resume=auto"]
    failed = train(tmp_path, *options, fault="enospc@10", check=False)
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    path = tmp_path / "checkpoints" / "step000010.ckpt"
    assert (
        f"OSError: [Errno 28] Could not write the checkpoint {path} (step 10): No space left on "
        "device." in failed.stderr
    ), failed.stderr[-3000:]
    # The previous checkpoints and metrics.csv as they were: no partial file, rows up to 9.
    assert checkpoint_files(tmp_path) == UP_TO_5
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 5
    assert metrics(tmp_path) == metrics(uninterrupted)[: len(metrics(tmp_path))]
    assert training_steps(tmp_path)[-1] == 9
    train(tmp_path, *options)
    assert_same_run(tmp_path, uninterrupted)


def test_resume_from_an_earlier_checkpoint_then_kill_then_auto(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # Continue a finished 12-step run from its step 5 in its own directory: last.ckpt (12) and
    # step 10 are of the continuation this run replaces, so they are moved aside; a kill
    # after step 10's checkpoint is written (not yet in place) and resume=auto must then go on
    # from step 5, not from the old last.ckpt (that would leave steps 10 to 12 without rows).
    for name, content in snapshot(uninterrupted).items():
        if name != ".run.lock":
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_bytes(content)
    step5 = tmp_path / "checkpoints" / "step000005.ckpt"
    killed = train(
        tmp_path, "trainer.max_steps=12", f"resume={step5}",
        fault="kill-after-checkpoint-write@10", check=False,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "is after step 5, which this run resumes from and trains again" in killed.stdout
    assert [name for name in checkpoint_files(tmp_path) if ".tmp-" not in name] == [
        "last.ckpt.superseded", "step000005.ckpt", "step000010.ckpt.superseded",
    ]  # fmt: skip
    result = train(tmp_path, "trainer.max_steps=12", "resume=auto")
    assert f"resume=auto: resuming from {step5} (step 5)" in result.stdout
    assert_same_run(tmp_path, uninterrupted)
