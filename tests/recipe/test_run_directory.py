"""The run directory: the ``resume=`` checkpoint checked before anything else, with errors that
say what to do (``resume=auto``: the newest intact one, the damaged ones reported); refusal,
resume, overwrite, the lock, and the config history."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bert_reduce.recipe.run_directory import (
    LOCK_NAME,
    ResumePoint,
    RunDirectory,
    RunDirectoryError,
    move_aside,
    resume_point,
)
from tests.helpers.recipe_runs import recipe_checkpoint


def cut(path: Path, size: int = 1000) -> Path:
    path.write_bytes(path.read_bytes()[:size])
    return path


def test_a_named_checkpoint_is_checked_and_its_later_ones_superseded(tmp_path: Path) -> None:
    # A missing, empty, garbage, truncated or other-batch-size file: the probes of
    # tests/integration/test_bad_inputs.py, through train.py.
    assert resume_point(None, tmp_path, 16) is None
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(ValueError, match=r"not a checkpoint written by train\.py") as raised:
        resume_point(path, tmp_path, 16)
    assert f"resume={path}" in str(raised.value)
    for step in (5, 10):
        recipe_checkpoint(tmp_path / f"step{step:06d}.ckpt", step=step)
    cut(recipe_checkpoint(tmp_path / "step000020.ckpt", step=20), 30)  # not loadable: left
    five = tmp_path / "step000005.ckpt"
    assert resume_point(five, tmp_path / "other", 16) == ResumePoint(five, 5)
    assert resume_point(five, None, 16) == ResumePoint(five, 5)  # checked, directory not read
    assert resume_point(five, tmp_path, 16) == ResumePoint(
        five, 5, superseded=(tmp_path / "step000010.ckpt",)
    )


def test_auto_takes_the_checkpoint_of_the_most_steps(tmp_path: Path) -> None:
    assert resume_point("auto", tmp_path / "missing", 16) == ResumePoint(None, 0)
    recipe_checkpoint(tmp_path / "step000005.ckpt", step=5)
    recipe_checkpoint(tmp_path / "step000010.ckpt", step=10)
    recipe_checkpoint(tmp_path / "last.ckpt", step=10)
    assert resume_point("auto", tmp_path, 16) == ResumePoint(tmp_path / "last.ckpt", 10)
    # A kill between a step's two renames: its periodic checkpoint is in place, last.ckpt not.
    recipe_checkpoint(tmp_path / "step000015.ckpt", step=15)
    assert resume_point("auto", tmp_path, 16) == ResumePoint(tmp_path / "step000015.ckpt", 15)


def test_auto_skips_damaged_checkpoints(tmp_path: Path) -> None:
    recipe_checkpoint(tmp_path / "step000005.ckpt", step=5)
    cut(recipe_checkpoint(tmp_path / "step000010.ckpt", step=10), 30)
    recipe_checkpoint(tmp_path / "step000015.ckpt", step=15)
    cut(recipe_checkpoint(tmp_path / "last.ckpt", step=15), 200)
    (tmp_path / "notes.txt").write_text("not a checkpoint name")
    found = resume_point("auto", tmp_path, 16)
    assert (found.path, found.step) == (tmp_path / "step000015.ckpt", 15)
    assert [path.name for path, _ in found.damaged] == ["last.ckpt", "step000010.ckpt"]
    assert "not a readable PyTorch checkpoint" in found.damaged[0][1]
    # None intact: start from step 0.
    for path in tmp_path.glob("step*.ckpt"):
        path.write_bytes(b"")
    found = resume_point("auto", tmp_path, 16)
    assert (found.path, found.step, len(found.damaged)) == (None, 0, 4)
    assert "empty" in found.damaged[1][1]


def test_move_aside_never_overwrites(tmp_path: Path) -> None:
    for content in (b"first", b"second", b"third"):
        (tmp_path / "last.ckpt").write_bytes(content)
        move_aside(tmp_path / "last.ckpt")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {
        "last.ckpt.damaged": b"first",
        "last.ckpt.damaged.1": b"second",
        "last.ckpt.damaged.2": b"third",
    }


def used_run(run_dir: Path) -> Path:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"state")
    (run_dir / "metrics.csv").write_text("step,train_loss\n1,3.5\n")
    (run_dir / "config.yaml").write_text("seed: 0\n")
    return run_dir / "checkpoints"


def start(run_dir: Path, resume: Path | str | None = None, overwrite: bool = False) -> None:
    with RunDirectory(run_dir) as directory:
        directory.start(resume, overwrite)


def test_a_used_directory_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    start(tmp_path)  # no run
    checkpoints = used_run(tmp_path / "used")
    run_dir = checkpoints.parent
    (run_dir / LOCK_NAME).write_text("pid 1 on host h, started ...\n")
    # A new run, or overwrite=true with resume= of this run or resume=auto: the probes of
    # tests/integration/test_bad_inputs.py (through train.py, the directory left unchanged).
    # Resuming from another directory's checkpoint does not continue this run either.
    with pytest.raises(RunDirectoryError, match="already holds a run"):
        start(run_dir, tmp_path / "x" / "last.ckpt")
    # Refused: nothing changed, the lock file included.
    assert (run_dir / LOCK_NAME).read_text() == "pid 1 on host h, started ...\n"
    for resume in ("auto", checkpoints / "last.ckpt", checkpoints / "step000005.ckpt"):
        start(run_dir, resume)  # resuming this run
    assert (checkpoints / "last.ckpt").read_bytes() == b"state"
    (run_dir / "notes.txt").write_text("mine")
    start(run_dir, None, True)
    assert sorted(p.name for p in run_dir.rglob("*")) == [LOCK_NAME, "checkpoints", "notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "mine"  # not the recipe's: kept


def test_config_history_is_kept(tmp_path: Path) -> None:
    directory = RunDirectory(tmp_path)
    assert directory.save_config("a: 1\n") is None
    assert directory.save_config("a: 1\n") is None  # same: nothing kept
    assert directory.save_config("a: 2\n") == tmp_path / "config.1.yaml"
    assert directory.save_config("a: 3\n") == tmp_path / "config.2.yaml"
    texts = [(tmp_path / n).read_text() for n in ("config.1.yaml", "config.2.yaml", "config.yaml")]
    assert texts == ["a: 1\n", "a: 2\n", "a: 3\n"]


def test_leftover_temporary_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    checkpoints = used_run(tmp_path)
    leftovers = [
        checkpoints / "last.ckpt.tmp-4242",
        checkpoints / "step000010.ckpt.tmp-4242.tmp-4242",
        tmp_path / "metrics.csv.tmp-17",
    ]
    kept = [checkpoints / "last.ckpt.damaged", checkpoints / "notes.tmp-x", tmp_path / "a.tmp"]
    for path in leftovers + kept:
        path.write_bytes(b"partial")
    start(tmp_path, "auto")
    assert not any(path.exists() for path in leftovers)
    assert all(path.exists() for path in kept)
    assert (checkpoints / "last.ckpt").read_bytes() == b"state"
