"""The run directory: the checkpoint a run resumes from, and what a run may do to the directory.

A run never overwrites another run's files, and one runs at a time: what holds a run, what may
start on it and the lock: docs/recipe.md, "The run directory". Lightning reads the ``resume=``
checkpoint only once training starts, where a missing or bad file fails with a bare
``FileNotFoundError``, ``EOFError`` or unpickling error; read here first (memory-mapped), it is
refused before the run directory is touched, named, with the checkpoints next to it. Which
checkpoint ``resume=auto`` takes, and why: docs/recipe.md, "Preemptible clusters".
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from bert_reduce.recipe.callbacks import LAST_NAME
from bert_reduce.recipe.files import TEMPORARY, write_atomically

AUTO = "auto"
"""``resume=auto``: resume from the run directory's newest intact checkpoint, if any."""

DATAMODULE_STATE_KEY = "ESMDataModule"
"""Where Lightning stores the data module's ``state_dict`` in a checkpoint (its class name)."""

LOCK_NAME = ".run.lock"
"""The lock file in the run directory; it stays there, held only while a run is running."""

RUN_OUTPUTS = ("metrics.csv", "config.yaml", "curves.png", "tensorboard")
"""What ``train.py`` writes into a run directory, besides checkpoints."""

log = logging.getLogger(__name__)


def _others(path: Path) -> str:
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p != path)
    if not others:
        return ""
    return f" Checkpoints in {path.parent}: {', '.join(others)}."


def _load(path: Path) -> Any:
    """``torch.load`` of ``path``, memory-mapped; a ``ValueError`` saying why it does not load."""
    if path.stat().st_size == 0:
        raise ValueError("the file is empty (0 bytes), e.g. from a write that was cut off")
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":  # every torch.save file is a zip archive
            raise ValueError(
                "not a PyTorch checkpoint (it does not start as torch.save's zip archive does): "
                "a corrupt file or another kind of file"
            )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(
            f"not a readable PyTorch checkpoint ({type(error).__name__}: {first_line}). The file "
            "is corrupt, e.g. cut short"
        ) from error


def _resume_step(path: Path, checkpoint: Any, global_batch_size: int) -> int:
    if not isinstance(checkpoint, dict) or DATAMODULE_STATE_KEY not in checkpoint:
        raise ValueError(
            f"resume={path}: not a checkpoint written by train.py (it holds no "
            f"{DATAMODULE_STATE_KEY!r} state, so the data position cannot be restored)."
        )
    saved = checkpoint[DATAMODULE_STATE_KEY]["global_batch_size"]
    if saved != global_batch_size:
        raise ValueError(
            f"resume={path} was trained with data.global_batch_size={saved}, this run has "
            f"data.global_batch_size={global_batch_size}. A resumed run must keep the global "
            f"batch size (its checkpoint counts global batches): set "
            f"data.global_batch_size={saved}, or start a new run."
        )
    return int(checkpoint["global_step"])


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes: ``resume=<file>``'s checkpoint, or the one ``resume=auto`` found.

    Attributes:
        path: The checkpoint to resume from; ``None``: start from step 0.
        step: Its ``global_step`` (0 without a checkpoint).
        damaged: ``resume=auto``: the checkpoints that did not load, each with the reason.
        superseded: A named checkpoint of the run directory: that directory's loadable
            checkpoints of more steps, of the continuation this run abandons (docs/recipe.md,
            "Preemptible clusters": why they go aside).
    """

    path: Path | None
    step: int
    damaged: tuple[tuple[Path, str], ...] = ()
    superseded: tuple[Path, ...] = ()


def resume_point(
    resume: str | Path | None, checkpoint_dir: Path | None, global_batch_size: int
) -> ResumePoint | None:
    """Where a run resumes, after checking that it can. Reads only.

    Args:
        resume: ``cfg.resume``: a checkpoint, ``"auto"`` or ``None``.
        checkpoint_dir: The run's checkpoint directory (may not exist yet; ``None``: not read).
        global_batch_size: This run's ``data.global_batch_size``.

    Returns:
        ``None`` without ``resume``. For ``resume=auto``, the loadable checkpoint of the most
        steps (``last.ckpt`` among equals), or none, and the files that did not load; for a
        named checkpoint of ``checkpoint_dir``, the later ones.

    Raises:
        FileNotFoundError: If the named checkpoint is not a file.
        ValueError: If the named checkpoint is empty or not a (readable) PyTorch checkpoint;
            or if it, or one of ``resume=auto``'s that loads, is not a ``train.py``
            checkpoint or was trained with another global batch size (a configuration to
            fix, not a damaged file).
    """
    if resume is None:
        return None
    if resume != AUTO:
        path = Path(resume)
        if not path.is_file():
            raise FileNotFoundError(f"resume={path}: no such checkpoint file.{_others(path)}")
        try:
            checkpoint = _load(path)
        except ValueError as error:
            raise ValueError(
                f"resume={path}: {error}. Resume from another checkpoint.{_others(path)}"
            ) from error
        step = _resume_step(path, checkpoint, global_batch_size)
        if checkpoint_dir is None or path.resolve().parent != checkpoint_dir.resolve():
            return ResumePoint(path, step)
    loaded, damaged = [], []
    for other in sorted(checkpoint_dir.glob("*.ckpt")):
        try:
            loaded.append((other, _load(other)))
        except ValueError as error:
            damaged.append((other, str(error)))
    if resume != AUTO:
        later = (p for p, c in loaded if isinstance(c, dict) and c.get("global_step", -1) > step)
        return ResumePoint(path, step, superseded=tuple(later))
    steps = [
        (_resume_step(path, checkpoint, global_batch_size), path.name == LAST_NAME, path)
        for path, checkpoint in loaded
    ]
    step, _, path = max(steps, default=(0, False, None))
    return ResumePoint(path, step, tuple(damaged))


def move_aside(path: Path, reason: str = "damaged") -> Path:
    """Rename ``path`` to ``<name>.<reason>`` (``.<reason>.1``, ...: never over a file)."""
    names = (f"{path.name}.{reason}" + (f".{n}" if n else "") for n in itertools.count())
    target = next(other for other in map(path.with_name, names) if not other.exists())
    os.replace(path, target)
    return target


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
        if resume == AUTO:
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
            names = (f"config.{n}.yaml" for n in itertools.count(1))
            kept = next(other for other in map(path.with_name, names) if not other.exists())
            os.replace(path, kept)
        write_atomically(path, lambda file: file.write(text.encode()))
        return kept
