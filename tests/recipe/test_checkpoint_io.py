"""Checkpoints are whole or absent: a failed write leaves the previous file untouched."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from bert_reduce.recipe.checkpoint_io import AtomicCheckpointIO


class FullDisk:
    """Pickling it fails the way a write to a full disk does, after other bytes were written."""

    def __reduce__(self) -> tuple:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "step000015.ckpt"
    io.save_checkpoint({"weights": torch.arange(4.0), "global_step": 10}, path)
    before = path.read_bytes()
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"weights": torch.zeros(1 << 16), "later": FullDisk()}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["step000015.ckpt"]  # no temp file
    assert io.load_checkpoint(path)["global_step"] == 10


def test_first_write_that_fails_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    with pytest.raises(OSError):
        AtomicCheckpointIO().save_checkpoint({"later": FullDisk()}, path)
    assert list(tmp_path.iterdir()) == []
