"""Checkpoints are whole or absent: a failed write leaves the previous file untouched."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from bert_reduce.recipe import files
from bert_reduce.recipe.files import AtomicCheckpointIO
from tests.helpers.faults import FillingFile


def test_a_failed_write_keeps_the_previous_file_and_names_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a real full file system (checked on a 256 KiB tmpfs): write() fails with ENOSPC
    # after what fits, and torch.save turns it into "RuntimeError: [enforce fail at
    # inline_container.cc:672] . unexpected pos ..." that names neither the file nor the cause.
    # No previous file (none, and no temporary file, left): enospc@15 in test_fault_tolerance.py.
    path = tmp_path / "checkpoints" / "last.ckpt"

    def filling_open(file, mode="r", *args, **kwargs):
        return FillingFile(open(file, mode, *args, **kwargs), room=64 * 1024)

    AtomicCheckpointIO().save_checkpoint({"global_step": 10}, path)
    before = path.read_bytes()
    monkeypatch.setattr(files, "open", filling_open, raising=False)
    with pytest.raises(OSError) as raised:
        AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(1 << 16)}, path)
    error = raised.value
    assert (error.errno, error.strerror) == (errno.ENOSPC, "No space left on device")
    assert error.filename == f"{path}.tmp-{os.getpid()}"
    assert isinstance(error.__cause__, RuntimeError)  # what torch.save raised
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file
