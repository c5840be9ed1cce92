"""The ``resume=`` checkpoint is checked before anything else, with errors that say what to do;
``resume=auto`` finds the newest intact one and reports the damaged ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bert_reduce.recipe.resume import ResumePoint, move_aside, resume_point
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
    with pytest.raises(ValueError, match=r"data\.global_batch_size=16, this run has"):
        resume_point("auto", tmp_path, 32)  # a configuration to fix, not a damaged file


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
