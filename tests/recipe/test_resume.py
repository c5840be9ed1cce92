"""The ``resume=`` checkpoint is checked before anything else, with errors that say what to do;
``resume=auto`` finds the newest intact one and reports the damaged ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bert_reduce.recipe.resume import (
    DATAMODULE_STATE_KEY,
    ResumePoint,
    find_resume_checkpoint,
    later_checkpoints,
    move_aside,
    read_resume_step,
)


def recipe_checkpoint(path: Path, global_batch_size: int = 16, step: int = 7) -> Path:
    torch.save(
        {DATAMODULE_STATE_KEY: {"global_batch_size": global_batch_size}, "global_step": step}, path
    )
    return path


def test_valid_checkpoint_gives_its_step(tmp_path: Path) -> None:
    assert read_resume_step(recipe_checkpoint(tmp_path / "last.ckpt"), 16) == 7


@pytest.mark.parametrize(
    ("content", "error", "match"),
    [
        (None, FileNotFoundError, "no such checkpoint file. Checkpoints in .*: step000005.ckpt"),
        (b"", ValueError, r"the file is empty \(0 bytes\)"),
        (b"\x80garbage\xff" * 10, ValueError, "not a PyTorch checkpoint"),
    ],
)
def test_unusable_file_is_named(
    tmp_path: Path, content: bytes | None, error: type, match: str
) -> None:
    recipe_checkpoint(tmp_path / "step000005.ckpt")
    path = tmp_path / "last.ckpt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=match) as raised:
        read_resume_step(path, 16)
    assert f"resume={path}" in str(raised.value)


def test_checkpoint_of_something_else_is_refused(tmp_path: Path) -> None:
    torch.save({"state_dict": {}}, tmp_path / "model.ckpt")
    with pytest.raises(ValueError, match=r"not a checkpoint written by train\.py"):
        read_resume_step(tmp_path / "model.ckpt", 16)


def test_other_global_batch_size_is_refused(tmp_path: Path) -> None:
    path = recipe_checkpoint(tmp_path / "last.ckpt", global_batch_size=16)
    with pytest.raises(
        ValueError, match=r"global_batch_size=16, this run has data\.global_batch_size=32"
    ):
        read_resume_step(path, 32)


def cut(path: Path, size: int = 1000) -> Path:
    path.write_bytes(path.read_bytes()[:size])
    return path


def test_auto_takes_the_checkpoint_of_the_most_steps(tmp_path: Path) -> None:
    recipe_checkpoint(tmp_path / "step000005.ckpt", step=5)
    recipe_checkpoint(tmp_path / "step000010.ckpt", step=10)
    recipe_checkpoint(tmp_path / "last.ckpt", step=10)
    assert find_resume_checkpoint(tmp_path, 16) == ResumePoint(tmp_path / "last.ckpt", 10)
    # A kill between a step's two renames: its periodic checkpoint is in place, last.ckpt not.
    recipe_checkpoint(tmp_path / "step000015.ckpt", step=15)
    assert find_resume_checkpoint(tmp_path, 16) == ResumePoint(tmp_path / "step000015.ckpt", 15)


def test_later_checkpoints_are_those_after_a_step(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        recipe_checkpoint(tmp_path / f"step{step:06d}.ckpt", step=step)
    recipe_checkpoint(tmp_path / "last.ckpt", step=15)
    cut(recipe_checkpoint(tmp_path / "step000020.ckpt", step=20), 30)  # not loadable: left
    assert later_checkpoints(tmp_path, 10) == [tmp_path / "last.ckpt", tmp_path / "step000015.ckpt"]


def test_auto_skips_a_damaged_last_ckpt_for_the_newest_step_that_loads(tmp_path: Path) -> None:
    recipe_checkpoint(tmp_path / "step000005.ckpt", step=5)
    cut(recipe_checkpoint(tmp_path / "step000010.ckpt", step=10), 30)
    recipe_checkpoint(tmp_path / "step000015.ckpt", step=15)
    cut(recipe_checkpoint(tmp_path / "last.ckpt", step=15), 200)
    (tmp_path / "notes.txt").write_text("not a checkpoint name")
    found = find_resume_checkpoint(tmp_path, 16)
    assert (found.path, found.step) == (tmp_path / "step000015.ckpt", 15)
    assert [path.name for path, _ in found.damaged] == ["last.ckpt", "step000010.ckpt"]
    assert "not a readable PyTorch checkpoint" in found.damaged[0][1]


def test_auto_without_an_intact_checkpoint_starts_from_step_0(tmp_path: Path) -> None:
    assert find_resume_checkpoint(tmp_path / "missing", 16) == ResumePoint(None, 0)
    (tmp_path / "last.ckpt").write_bytes(b"")
    found = find_resume_checkpoint(tmp_path, 16)
    assert (found.path, found.step) == (None, 0)
    assert found.damaged == ((tmp_path / "last.ckpt", found.damaged[0][1]),)
    assert "empty" in found.damaged[0][1]


def test_auto_refuses_a_checkpoint_of_another_configuration(tmp_path: Path) -> None:
    recipe_checkpoint(tmp_path / "last.ckpt", global_batch_size=32)
    with pytest.raises(ValueError, match=r"data\.global_batch_size=32, this run has"):
        find_resume_checkpoint(tmp_path, 16)


def test_move_aside_never_overwrites(tmp_path: Path) -> None:
    for content in (b"first", b"second", b"third"):
        (tmp_path / "last.ckpt").write_bytes(content)
        move_aside(tmp_path / "last.ckpt")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {
        "last.ckpt.damaged": b"first",
        "last.ckpt.damaged.1": b"second",
        "last.ckpt.damaged.2": b"third",
    }
