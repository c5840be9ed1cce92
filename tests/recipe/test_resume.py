"""The ``resume=`` checkpoint is checked before anything else, with errors that say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bert_reduce.recipe.resume import DATAMODULE_STATE_KEY, read_resume_step


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
