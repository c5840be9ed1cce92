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
    "find_resume_checkpoint",
    "later_checkpoints",
    "move_aside",
    "read_resume_step",
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


def read_resume_step(path: str | Path, global_batch_size: int) -> int:
    """The optimizer steps done in a ``train.py`` checkpoint, after checking it can resume.

    Args:
        path: The ``resume=`` checkpoint.
        global_batch_size: This run's ``data.global_batch_size``.

    Returns:
        The checkpoint's ``global_step``.

    Raises:
        FileNotFoundError: If ``path`` is not a file.
        ValueError: If it is empty, not a (readable) PyTorch checkpoint, not a ``train.py``
            checkpoint, or was trained with another global batch size.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"resume={path}: no such checkpoint file.{_others(path)}")
    try:
        checkpoint = _load(path)
    except ValueError as error:
        raise ValueError(
            f"resume={path}: {error}. Resume from another checkpoint.{_others(path)}"
        ) from error
    return _resume_step(path, checkpoint, global_batch_size)


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes: ``resume=<file>``'s checkpoint, or the one ``resume=auto`` found.

    Attributes:
        path: The checkpoint to resume from; ``None``: start from step 0.
        step: Its ``global_step`` (0 without a checkpoint).
        damaged: The checkpoints that did not load, each with the reason.
    """

    path: Path | None
    step: int
    damaged: tuple[tuple[Path, str], ...] = ()


def _loadable(checkpoint_dir: Path) -> tuple[list[tuple[Path, Any]], list[tuple[Path, str]]]:
    """The ``*.ckpt`` of ``checkpoint_dir`` that load, and those that do not with the reason."""
    loaded, damaged = [], []
    for path in sorted(checkpoint_dir.glob("*.ckpt")):
        try:
            loaded.append((path, _load(path)))
        except ValueError as error:
            damaged.append((path, str(error)))
    return loaded, damaged


def find_resume_checkpoint(checkpoint_dir: Path, global_batch_size: int) -> ResumePoint:
    """The newest intact checkpoint of ``checkpoint_dir``, for ``resume=auto``. Reads only.

    Args:
        checkpoint_dir: The run's checkpoint directory (may not exist yet).
        global_batch_size: This run's ``data.global_batch_size``.

    Returns:
        The loadable checkpoint of the most steps (``last.ckpt`` among equals), or none; and
        the files that did not load.

    Raises:
        ValueError: If a checkpoint that loads is not a ``train.py`` checkpoint or was trained
            with another global batch size (a configuration to fix, not a damaged file).
    """
    loaded, damaged = _loadable(checkpoint_dir)
    steps = [
        (_resume_step(path, checkpoint, global_batch_size), path.name == LAST_NAME, path)
        for path, checkpoint in loaded
    ]
    step, _, path = max(steps, default=(0, False, None))
    return ResumePoint(path, step, tuple(damaged))


def later_checkpoints(checkpoint_dir: Path, step: int) -> list[Path]:
    """The checkpoints of ``checkpoint_dir`` that load and hold more than ``step`` steps.

    Those of the continuation a run resumed from an earlier step abandons (docs/recipe.md,
    "Preemptible clusters": why they go aside). Reads only.
    """
    return [
        path
        for path, checkpoint in _loadable(checkpoint_dir)[0]
        if isinstance(checkpoint, dict) and int(checkpoint.get("global_step", -1)) > step
    ]


def move_aside(path: Path, reason: str = "damaged") -> Path:
    """Rename ``path`` to ``<name>.<reason>`` (``.<reason>.1``, ...: never over a file)."""
    target = path.with_name(f"{path.name}.{reason}")
    number = 0
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}.{reason}.{number}")
    os.replace(path, target)
    return target
