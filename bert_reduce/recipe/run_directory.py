"""Run directory safety: a run never overwrites another run's files, and one runs at a time.

What holds a run, what may start on it and the lock: docs/recipe.md, "The run directory".
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import IO

from bert_reduce.recipe.files import TEMPORARY, write_atomically

__all__ = [
    "LOCK_NAME",
    "RUN_OUTPUTS",
    "RunDirectoryError",
    "RunDirectoryLock",
    "check_run_directory",
    "existing_outputs",
    "remove_leftovers",
    "remove_outputs",
    "save_config_keeping_previous",
]

LOCK_NAME = ".run.lock"
"""The lock file in the run directory; it stays there, held only while a run is running."""

RUN_OUTPUTS = ("metrics.csv", "config.yaml", "curves.png", "tensorboard")
"""What ``train.py`` writes into a run directory, besides checkpoints."""


class RunDirectoryError(RuntimeError):
    """A run may not start in this directory (it holds another run, or a run is running)."""


def existing_outputs(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """A previous run's outputs in ``run_dir`` and checkpoints in ``checkpoint_dir``, sorted."""
    found = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    # Checkpoints, not their directory: a directory holding no checkpoint is no run.
    return sorted(found + list(checkpoint_dir.glob("*.ckpt")))


def check_run_directory(
    run_dir: Path, checkpoint_dir: Path, resume: Path | str | None, overwrite: bool
) -> list[Path]:
    """Refuse to start a run that would mix with or overwrite another run's files.

    Args:
        run_dir: The run directory.
        checkpoint_dir: This run's checkpoint directory.
        resume: ``cfg.resume``: a checkpoint, ``"auto"`` or ``None``.
        overwrite: ``cfg.overwrite``.

    Returns:
        The previous run's outputs to delete once the run has started (unless ``overwrite``,
        none).

    Raises:
        RunDirectoryError: If the directory holds a run that this one neither resumes nor may
            overwrite, or ``overwrite`` is combined with resuming the directory's run.
    """
    if resume == "auto":
        if overwrite:
            raise RunDirectoryError(
                "resume=auto continues the run in the run directory, overwrite=true deletes it: "
                "choose one."
            )
        return []
    resume = None if resume is None else Path(resume)
    resumes_here = resume is not None and resume.resolve().parent == checkpoint_dir.resolve()
    if overwrite and resumes_here:
        raise RunDirectoryError(
            f"overwrite=true would delete {resume}, the checkpoint that resume= continues from. "
            "Drop overwrite=true to continue this run in its directory, or resume into a new "
            "directory (hydra.run.dir=...)."
        )
    outputs = existing_outputs(run_dir, checkpoint_dir)
    if not outputs or resumes_here:
        return []
    if overwrite:
        return outputs
    shown = ", ".join(
        str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)
        for path in outputs[:6]
    )
    raise RunDirectoryError(
        f"The run directory {run_dir} already holds a run ({shown}). Nothing was changed. "
        f"To continue that run: resume=auto (its newest checkpoint), or "
        f"resume={checkpoint_dir / 'last.ckpt'}. To start a new run: choose another directory "
        "(hydra.run.dir=...). To replace that run and delete its outputs: overwrite=true."
    )


def remove_outputs(outputs: list[Path]) -> None:
    """Delete a previous run's outputs (what :func:`check_run_directory` returned)."""
    for path in outputs:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def remove_leftovers(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """Delete (and return) the temporary files a killed run left; only under the lock."""
    removed = []
    for directory in dict.fromkeys((run_dir, checkpoint_dir)):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if TEMPORARY.fullmatch(path.name) and path.is_file():
                path.unlink()
                removed.append(path)
    return removed


class RunDirectoryLock:
    """The run directory's lock, held from ``with`` entry to exit.

    Check the directory inside ``with``, then call :meth:`record_holder`: a run refused by
    the check leaves the lock file as it was.

    Args:
        run_dir: The run directory (created if missing).

    Raises:
        RunDirectoryError: On entry, if another process holds the lock, naming it.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self._handle: IO[str] | None = None

    def __enter__(self) -> RunDirectoryLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # held open (and locked) until __exit__
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "an unknown process"
            handle.close()
            raise RunDirectoryError(
                f"Another run is running in {self.run_dir}: {holder} holds {self.path}. Wait "
                "for it to finish (or stop it), or choose another directory (hydra.run.dir=...)."
            ) from None
        self._handle = handle
        return self

    def record_holder(self) -> None:
        """Write this process (host, pid, start time, command line) into the lock file."""
        assert self._handle is not None, "record_holder() needs the lock: use it in `with`."
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(
            f"pid {os.getpid()} on host {socket.gethostname()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}\n"
        )
        self._handle.flush()

    def __exit__(self, *exc_info: object) -> None:
        # Closing the file releases the lock; the file stays (removing it would race with a
        # process that opened it but has not locked it yet).
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def save_config_keeping_previous(text: str, path: Path) -> Path | None:
    """Write ``text`` to ``path``, keeping a different previous file as ``config.<n>.yaml``.

    Returns:
        Where the previous config went, or ``None`` if there was none or it was the same.
    """
    kept = None
    if path.is_file() and path.read_text() != text:
        number = 1
        while (kept := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists():
            number += 1
        os.replace(path, kept)
    write_atomically(path, lambda file: file.write(text.encode()))
    return kept
