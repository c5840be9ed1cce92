"""Checkpoints written under a temporary name and renamed: a checkpoint file is whole or absent.

Lightning's ``TorchCheckpointIO`` writes through an ``fsspec`` transaction whose local
commit moves a temporary file into place without ``fsync``, so a crash right after the rename
can still leave a truncated file under the final name. Here the bytes are written and
synced under ``<name>.tmp-<pid>`` next to the target, then ``os.replace`` renames it (atomic
on POSIX) and the directory entry is synced. A failed write (a full disk, say) removes the
temporary file, leaves the previous checkpoint of that name untouched, and raises an ``OSError``
that names the file and the cause (``torch.save`` itself reports a full disk as a bare
``RuntimeError``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "save_atomically"]


class _ErrorRecordingWriter:
    """Passes ``write``/``flush`` to a file and keeps the first ``OSError`` they raise.

    ``torch.save`` replaces a failed write (``ENOSPC``, ``EIO``, ...) by a ``RuntimeError``
    that names neither the file nor the cause (``[enforce fail at inline_container.cc:672] .
    unexpected pos 704 vs 598`` on a full disk, torch 2.13).
    """

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        try:
            self.handle.flush()
        except OSError as error:
            self.error = self.error or error
            raise


def save_atomically(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.save`` into a temporary file next to ``path``, fsync it, rename it to ``path``.

    Args:
        checkpoint: What ``torch.save`` accepts.
        path: The final name; its directory is created if missing.

    Raises:
        OSError: From writing (e.g. ``errno.ENOSPC``, no space left), with the cause's
            ``errno`` and ``strerror`` and the file being written as ``filename``; ``path`` is
            then unchanged and the temporary file removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    writer: _ErrorRecordingWriter | None = None
    try:
        with open(temporary, "wb") as handle:
            writer = _ErrorRecordingWriter(handle)
            torch.save(checkpoint, writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        cause = writer.error if writer is not None and writer.error is not None else error
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror or str(cause), str(temporary)) from error
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
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save ``checkpoint`` to ``path``, whole or not at all (local files)."""
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        save_atomically(checkpoint, path)
