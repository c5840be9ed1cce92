"""The checkpoint a run resumes from: named (``resume=<file>``) or found (``resume=auto``).

Lightning reads the checkpoint only once training starts, where a missing or bad file fails
with a bare ``FileNotFoundError``, ``EOFError`` or unpickling error; read here first
(memory-mapped), it is refused before the run directory is touched, named, with the
checkpoints next to it. Which checkpoint ``resume=auto`` takes, and why: docs/recipe.md,
"Preemptible clusters".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bert_reduce.recipe.callbacks import LAST_NAME

__all__ = [
    "AUTO",
    "DATAMODULE_STATE_KEY",
    "ResumePoint",
    "move_aside",
    "resume_point",
]

AUTO = "auto"
"""``resume=auto``: resume from the run directory's newest intact checkpoint, if any."""

DATAMODULE_STATE_KEY = "ESMDataModule"
"""Where Lightning stores the data module's ``state_dict`` in a checkpoint (its class name)."""


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
    resume: str | Path | None, checkpoint_dir: Path, global_batch_size: int
) -> ResumePoint | None:
    """Where a run resumes, after checking that it can. Reads only.

    Args:
        resume: ``cfg.resume``: a checkpoint, ``"auto"`` or ``None``.
        checkpoint_dir: The run's checkpoint directory (may not exist yet).
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
        if path.resolve().parent != checkpoint_dir.resolve():
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
    target = path.with_name(f"{path.name}.{reason}")
    number = 0
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}.{reason}.{number}")
    os.replace(path, target)
    return target
