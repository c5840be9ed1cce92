"""Run directory safety: refusal, resume, overwrite, the lock, and the config history."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bert_reduce.recipe.run_directory import (
    LOCK_NAME,
    RunDirectoryError,
    RunDirectoryLock,
    check_run_directory,
    existing_outputs,
    remove_leftovers,
    remove_outputs,
    save_config_keeping_previous,
)


def used_run(run_dir: Path) -> Path:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"state")
    (run_dir / "metrics.csv").write_text("step,train_loss\n1,3.5\n")
    (run_dir / "config.yaml").write_text("seed: 0\n")
    return run_dir / "checkpoints"


def test_a_used_directory_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / LOCK_NAME).write_text("")
    assert check_run_directory(tmp_path, tmp_path / "checkpoints", None, False) == []  # no run
    checkpoints = used_run(tmp_path / "used")
    run_dir = checkpoints.parent
    with pytest.raises(RunDirectoryError, match="already holds a run") as error:
        check_run_directory(run_dir, checkpoints, None, False)
    message = str(error.value)
    assert "checkpoints/last.ckpt, config.yaml, metrics.csv" in message
    assert f"resume={checkpoints / 'last.ckpt'}" in message and "overwrite=true" in message
    # Resuming from another directory's checkpoint does not continue this run either.
    with pytest.raises(RunDirectoryError, match="already holds a run"):
        check_run_directory(run_dir, checkpoints, tmp_path / "x" / "last.ckpt", False)
    for name in ("last.ckpt", "step000005.ckpt"):  # resuming this run
        assert check_run_directory(run_dir, checkpoints, checkpoints / name, False) == []
    with pytest.raises(RunDirectoryError, match="overwrite=true would delete"):
        check_run_directory(run_dir, checkpoints, checkpoints / "last.ckpt", True)
    (run_dir / "notes.txt").write_text("mine")
    previous = check_run_directory(run_dir, checkpoints, None, True)
    assert [p.name for p in previous] == ["last.ckpt", "config.yaml", "metrics.csv"]
    remove_outputs(previous)
    assert existing_outputs(run_dir, checkpoints) == []
    assert (run_dir / "notes.txt").read_text() == "mine"  # not the recipe's: kept


def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("pid 1 on host h, started ...\n")
    with RunDirectoryLock(tmp_path) as lock:
        # Unchanged until the holder is recorded: a run refused by the checks leaves it.
        assert (tmp_path / LOCK_NAME).read_text() == "pid 1 on host h, started ...\n"
        lock.record_holder()
        with (
            pytest.raises(RunDirectoryError, match=f"pid {os.getpid()} on host"),
            RunDirectoryLock(tmp_path),
        ):
            pass
    with RunDirectoryLock(tmp_path):  # released
        pass


def test_config_history_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    assert save_config_keeping_previous("a: 1\n", path) is None
    assert save_config_keeping_previous("a: 1\n", path) is None  # same: nothing kept
    assert save_config_keeping_previous("a: 2\n", path) == tmp_path / "config.1.yaml"
    assert save_config_keeping_previous("a: 3\n", path) == tmp_path / "config.2.yaml"
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
    assert sorted(remove_leftovers(tmp_path, checkpoints)) == sorted(leftovers)
    assert not any(path.exists() for path in leftovers)
    assert all(path.exists() for path in kept)
    assert (checkpoints / "last.ckpt").read_bytes() == b"state"
