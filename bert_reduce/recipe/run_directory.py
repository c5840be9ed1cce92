"""Run directory safety: a run never overwrites another run's files, and one runs at a time.

What holds a run, what may start on it and the lock: docs/recipe.md, "The run directory".
"""

from __future__ import annotations

import fcntl
import logging
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
    "RunDirectory",
    "RunDirectoryError",
]

LOCK_NAME = ".run.lock"
"""The lock file in the run directory; it stays there, held only while a run is running."""

RUN_OUTPUTS = ("metrics.csv", "config.yaml", "curves.png", "tensorboard")
"""What ``train.py`` writes into a run directory, besides checkpoints."""


log = logging.getLogger(__name__)


class RunDirectoryError(RuntimeError):
    """A run may not start in this directory (it holds another run, or a run is running)."""


class RunDirectory:
    """The run directory, locked from ``with`` entry to exit, and what a run does to it there.

    Inside ``with``, :meth:`start` checks the directory and takes it for this run; a run it
    refuses leaves the directory, the lock file included, as it was.

    Args:
        run_dir: The run directory (created if missing).
        checkpoint_dir: This run's checkpoint directory (default: ``run_dir/checkpoints``).

    Raises:
        RunDirectoryError: On entry, if another process holds the lock, naming it.
    """

    def __init__(self, run_dir: Path, checkpoint_dir: Path | None = None) -> None:
        self.run_dir = run_dir
        self.checkpoint_dir = checkpoint_dir or run_dir / "checkpoints"
        self.lock_path = run_dir / LOCK_NAME
        self._handle: IO[str] | None = None

    def __enter__(self) -> RunDirectory:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.lock_path, "a+")  # held open (and locked) until __exit__
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "an unknown process"
            handle.close()
            raise RunDirectoryError(
                f"Another run is running in {self.run_dir}: {holder} holds {self.lock_path}. "
                "Wait for it to finish (or stop it), or choose another directory "
                "(hydra.run.dir=...)."
            ) from None
        self._handle = handle
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Closing the file releases the lock; the file stays (removing it would race with a
        # process that opened it but has not locked it yet).
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def start(self, resume: Path | str | None = None, overwrite: bool = False) -> None:
        """Refuse a run that would mix with or overwrite another run's files, else take it.

        Taking it: write this process (host, pid, start time, command line) into the lock
        file, delete the previous run's outputs (``overwrite``; nothing else) and the temporary
        files a killed run left.

        Args:
            resume: ``cfg.resume``: a checkpoint, ``"auto"`` or ``None``.
            overwrite: ``cfg.overwrite``.

        Raises:
            RunDirectoryError: If the directory holds a run that this one neither resumes nor
                may overwrite, or ``overwrite`` is combined with resuming the directory's run.
        """
        assert self._handle is not None, "start() needs the lock: use it in `with`."
        previous = self._previous_outputs(resume, overwrite)
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(
            f"pid {os.getpid()} on host {socket.gethostname()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}\n"
        )
        self._handle.flush()
        for path in previous:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        for directory in dict.fromkeys((self.run_dir, self.checkpoint_dir)):
            for path in sorted(directory.iterdir()) if directory.is_dir() else ():
                if TEMPORARY.fullmatch(path.name) and path.is_file():
                    path.unlink()
                    log.info("Removed %s, a temporary file that an interrupted run left.", path)

    def _previous_outputs(self, resume: Path | str | None, overwrite: bool) -> list[Path]:
        """The previous run's outputs that ``overwrite`` deletes; raises for a refused run."""
        run_dir, checkpoint_dir = self.run_dir, self.checkpoint_dir
        if resume == "auto":
            if overwrite:
                raise RunDirectoryError(
                    "resume=auto continues the run in the run directory, overwrite=true deletes "
                    "it: choose one."
                )
            return []
        resume = None if resume is None else Path(resume)
        resumes_here = resume is not None and resume.resolve().parent == checkpoint_dir.resolve()
        if overwrite and resumes_here:
            raise RunDirectoryError(
                f"overwrite=true would delete {resume}, the checkpoint that resume= continues "
                "from. Drop overwrite=true to continue this run in its directory, or resume into "
                "a new directory (hydra.run.dir=...)."
            )
        outputs = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
        # Checkpoints, not their directory: a directory holding no checkpoint is no run.
        outputs = sorted(outputs + list(checkpoint_dir.glob("*.ckpt")))
        if resumes_here:
            return []
        if not outputs or overwrite:
            return outputs
        shown = ", ".join(
            str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)
            for path in outputs[:6]
        )
        raise RunDirectoryError(
            f"The run directory {run_dir} already holds a run ({shown}). Nothing was changed. "
            f"To continue that run: resume=auto (its newest checkpoint), or "
            f"resume={checkpoint_dir / 'last.ckpt'}. To start a new run: choose another "
            "directory (hydra.run.dir=...). To replace that run and delete its outputs: "
            "overwrite=true."
        )

    def save_config(self, text: str) -> Path | None:
        """Write ``config.yaml``: ``text``; a different previous one is kept as ``config.<n>.yaml``.

        Returns:
            Where the previous config went, or ``None`` if there was none or it was the same.
        """
        path, kept = self.run_dir / "config.yaml", None
        if path.is_file() and path.read_text() != text:
            number = 1
            while (kept := path.with_name(f"config.{number}.yaml")).exists():
                number += 1
            os.replace(path, kept)
        write_atomically(path, lambda file: file.write(text.encode()))
        return kept
