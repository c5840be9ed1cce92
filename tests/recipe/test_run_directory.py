"""Run directory safety: refusal, resume, overwrite, the lock, and the config history."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bert_reduce.recipe.run_directory import LOCK_NAME, RunDirectory, RunDirectoryError


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
    with pytest.raises(RunDirectoryError, match="already holds a run") as error:
        start(run_dir)
    message = str(error.value)
    assert "checkpoints/last.ckpt, config.yaml, metrics.csv" in message
    assert f"resume={checkpoints / 'last.ckpt'}" in message and "overwrite=true" in message
    # Resuming from another directory's checkpoint does not continue this run either.
    with pytest.raises(RunDirectoryError, match="already holds a run"):
        start(run_dir, tmp_path / "x" / "last.ckpt")
    with pytest.raises(RunDirectoryError, match="overwrite=true would delete"):
        start(run_dir, checkpoints / "last.ckpt", True)
    with pytest.raises(RunDirectoryError, match="resume=auto continues the run"):
        start(run_dir, "auto", True)
    # Refused: nothing changed, the lock file included.
    assert (run_dir / LOCK_NAME).read_text() == "pid 1 on host h, started ...\n"
    for resume in ("auto", checkpoints / "last.ckpt", checkpoints / "step000005.ckpt"):
        start(run_dir, resume)  # resuming this run
    assert (checkpoints / "last.ckpt").read_bytes() == b"state"
    (run_dir / "notes.txt").write_text("mine")
    start(run_dir, None, True)
    assert sorted(p.name for p in run_dir.rglob("*")) == [LOCK_NAME, "checkpoints", "notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "mine"  # not the recipe's: kept


def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    with RunDirectory(tmp_path) as directory:
        directory.start()
        with (
            pytest.raises(RunDirectoryError, match=f"pid {os.getpid()} on host"),
            RunDirectory(tmp_path),
        ):
            pass
    with RunDirectory(tmp_path):  # released
        pass


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
