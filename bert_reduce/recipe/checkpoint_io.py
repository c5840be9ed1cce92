"""Checkpoints written under a temporary name and renamed: a checkpoint file is whole or absent.

Lightning's ``TorchCheckpointIO`` writes through an ``fsspec`` transaction whose local
commit moves a temporary file into place without ``fsync``, so a crash right after the rename
can still leave a truncated file under the final name. Here the bytes are written and
synced under ``<name>.tmp-<pid>`` next to the target, then ``os.replace`` renames it (atomic
on POSIX) and the directory entry is synced. A failed write (a full disk, say) removes the
temporary file and leaves the previous checkpoint of that name untouched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "save_atomically"]


def save_atomically(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.save`` into a temporary file next to ``path``, fsync it, rename it to ``path``.

    Args:
        checkpoint: What ``torch.save`` accepts.
        path: The final name; its directory is created if missing.

    Raises:
        OSError: From writing (e.g. no space left); ``path`` is then unchanged.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves go through :func:`save_atomically`.

    Remote paths (``s3://``, ...) keep Lightning's ``fsspec`` transaction. Pass it to the
    Trainer as a plugin: ``Trainer(plugins=[AtomicCheckpointIO()])``.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` to ``path``, whole or not at all (local files)."""
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        save_atomically(checkpoint, path)
