"""Files a killed run leaves whole or absent: written under a temporary name, synced, renamed.

Every file ``train.py`` replaces (checkpoints, a rewritten ``metrics.csv``, ``config.yaml``)
goes through :func:`write_atomically` (docs/recipe.md, "The run directory").
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

TEMPORARY = re.compile(r".+\.tmp-[0-9]+")
"""The names :func:`temporary_name` gives."""


def temporary_name(path: str | os.PathLike[str]) -> Path:
    """Where ``path`` is written before it is renamed into place: ``<path>.tmp-<pid>``."""
    return Path(f"{os.fspath(path)}.tmp-{os.getpid()}")


def put_in_place(temporary: Path, path: Path) -> None:
    """Rename ``temporary`` to ``path`` and sync the directory entry to the disk."""
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class _ErrorRecordingFile:
    """Passes ``write`` and ``flush`` to a file and keeps the first ``OSError`` of ``write``.

    ``torch.save`` replaces a failed write (``ENOSPC``, ``EIO``, ...) by a ``RuntimeError``
    that names neither the file nor the cause (``[enforce fail at inline_container.cc:672] .
    unexpected pos 704 vs 598`` on a full disk, torch 2.13).
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.handle.flush()  # an OSError here reaches the caller as it is


def write_atomically(path: str | os.PathLike[str], write: Callable[[Any], object]) -> None:
    """``write(file)`` into ``path``'s temporary name, sync it, rename it to ``path``.

    Args:
        path: The final name; its directory is created if missing.
        write: Writes the content to the binary file it is given (``write``, ``flush``).

    Raises:
        OSError: From writing (e.g. ``errno.ENOSPC``, no space left), with the cause's
            ``errno`` and ``strerror`` and the temporary file as ``filename``; ``path`` is then
            unchanged and the temporary file removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    recording: _ErrorRecordingFile | None = None
    try:
        with open(temporary, "wb") as handle:
            recording = _ErrorRecordingFile(handle)
            write(recording)
            handle.flush()
            os.fsync(handle.fileno())
        put_in_place(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        cause = recording.error if recording is not None and recording.error else error
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror or str(cause), str(temporary)) from error
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves go through :func:`write_atomically`.

    Lightning's own writes through an ``fsspec`` transaction that renames without syncing, so
    a crash right after it can leave a truncated file under the final name. Local paths only,
    as the recipe's run directory is: ``Trainer(plugins=[AtomicCheckpointIO()])``.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Save ``checkpoint`` to ``path``, whole or not at all."""
        write_atomically(path, lambda file: torch.save(checkpoint, file))
