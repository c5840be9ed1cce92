"""Check a ``resume=`` checkpoint before anything else happens, with errors that say what to do.

Lightning reads the checkpoint only once training starts, and a missing, empty or corrupt
file then fails with a bare ``FileNotFoundError``, ``EOFError`` or unpickling error. Reading it
here first (memory-mapped, so large checkpoints cost little) lets ``train.py`` refuse before
it touches the run directory, name the file, and list the checkpoints next to it.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["DATAMODULE_STATE_KEY", "ZIP_MAGIC", "read_resume_step"]

ZIP_MAGIC = b"PK\x03\x04"
"""The first bytes of every ``torch.save`` file (a zip archive)."""

DATAMODULE_STATE_KEY = "ESMDataModule"
"""Where Lightning stores the data module's ``state_dict`` in a checkpoint (its class name)."""


def _others(path: Path) -> str:
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p != path)
    if not others:
        return ""
    return f" Checkpoints in {path.parent}: {', '.join(others)}."


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
    if path.stat().st_size == 0:
        raise ValueError(
            f"resume={path}: the file is empty (0 bytes), e.g. from a write that was cut off. "
            f"Resume from another checkpoint.{_others(path)}"
        )
    with open(path, "rb") as handle:
        if handle.read(4) != ZIP_MAGIC:
            raise ValueError(
                f"resume={path}: not a PyTorch checkpoint (it does not start as torch.save's zip "
                f"archive does): a corrupt file or another kind of file. Resume from another "
                f"checkpoint.{_others(path)}"
            )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ValueError(
            f"resume={path}: not a readable PyTorch checkpoint ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). The file is corrupt, e.g. "
            f"cut short; resume from another checkpoint.{_others(path)}"
        ) from error
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
