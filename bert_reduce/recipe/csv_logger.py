"""``metrics.csv`` that a resumed run appends to, each step exactly once, never half-written.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` as soon as its writer is created
(``lightning/fabric/loggers/csv_logs.py``, ``_check_log_dir_exists``), rewrites the whole file
in place when a new column appears (a kill during that rewrite loses the file), and does not
sync it to the disk. :class:`AppendingCSVLogger` writes the same file format (one row per
``log_metrics`` call, ``step`` and the metric names as sorted columns, empty cells for metrics
not logged in a row) with Lightning's public ``Logger`` interface only, and:

* appends to an existing ``metrics.csv``, keeping its columns;
* a run resumed from step ``k`` first drops the rows after step ``k`` (the interrupted run
  wrote them after its checkpoint, and the resumed run writes them again) and a last line cut
  short by a kill, at its first write, so a resume that fails to start changes nothing;
* rewrites the file only through a temporary file renamed into place, and syncs it to the disk
  at every save, so a checkpoint put in place after a save (``RunCheckpoint``) is never ahead
  of the rows on disk.

Whether a run may write into a directory that holds a ``metrics.csv`` at all is decided
before, by :mod:`bert_reduce.recipe.run_directory`.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

__all__ = ["METRICS_FILE", "AppendingCSVLogger", "keep_metrics_up_to", "read_metrics"]

METRICS_FILE = "metrics.csv"


def _fsync(handle: Any) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _write_atomically(path: Path, fieldnames: list[str], rows: list[dict[str, str]]) -> None:
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
            _fsync(handle)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_metrics(metrics_csv: Path) -> tuple[list[str], list[dict[str, str]], bool]:
    """The columns and whole rows of a ``metrics.csv``.

    Args:
        metrics_csv: The file.

    Returns:
        The header, the rows (as ``csv.DictReader`` gives them), and whether a last line cut
        short (no final newline: a write interrupted by a kill) was left out.
    """
    text = metrics_csv.read_text()
    cut = bool(text) and not text.endswith("\n")
    if cut:
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(text.splitlines(keepends=True))
    rows = list(reader)
    return list(reader.fieldnames or []), rows, cut


def keep_metrics_up_to(metrics_csv: Path, step: float) -> int:
    """Drop the rows of ``metrics_csv`` logged after ``step``; the file is replaced atomically.

    A last line cut short by a kill is dropped too.

    Args:
        metrics_csv: A ``metrics.csv`` with a ``step`` column; nothing happens if it is
            missing.
        step: The optimizer steps done in the checkpoint being resumed (``math.inf``: only
            drop a cut line).

    Returns:
        How many rows were dropped (a cut line counts as one).

    Raises:
        ValueError: If the file has no ``step`` column.
    """
    if not metrics_csv.is_file():
        return 0
    fieldnames, rows, cut = read_metrics(metrics_csv)
    if "step" not in fieldnames:
        raise ValueError(
            f"{metrics_csv} has no 'step' column (columns: {fieldnames or None}): it was not "
            "written by train.py. Move it away to resume in this directory."
        )
    kept = [row for row in rows if not row["step"] or float(row["step"]) <= step]
    if len(kept) == len(rows) and not cut:
        return 0
    _write_atomically(metrics_csv, fieldnames, kept)
    return len(rows) - len(kept) + cut


class AppendingCSVLogger(Logger):
    """Logs to ``<save_dir>/metrics.csv``, appending to an existing file (rank 0 only).

    Args:
        save_dir: The run directory.
        keep_steps_up_to: The step of the checkpoint this run resumes from: rows of later
            steps are dropped before the first new row is written. ``None``: keep every row.
    """

    def __init__(self, save_dir: str | os.PathLike[str], keep_steps_up_to: int | None = None):
        super().__init__()
        self._save_dir = os.fspath(save_dir)
        self.keep_steps_up_to = keep_steps_up_to
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] | None = None  # the file's header, once this run wrote

    @property
    @override
    def name(self) -> str:
        return ""

    @property
    @override
    def version(self) -> str:
        return ""

    @property
    @override
    def save_dir(self) -> str:
        return self._save_dir

    @property
    @override
    def log_dir(self) -> str:
        return self._save_dir

    @property
    def metrics_file(self) -> Path:
        """``<save_dir>/metrics.csv``."""
        return Path(self._save_dir) / METRICS_FILE

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the recipe writes the whole configuration to ``config.yaml``."""

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record one row: ``metrics`` and ``step`` (written at the next :meth:`save`)."""
        row = {
            name: value.item() if isinstance(value, Tensor) else value
            for name, value in metrics.items()
        }
        row["step"] = len(self._rows) if step is None else step
        self._rows.append(row)

    @override
    @rank_zero_only
    def save(self) -> None:
        """Append the recorded rows to ``metrics.csv`` and sync it to the disk."""
        if not self._rows:
            return
        path = self.metrics_file
        if self._columns is None:  # the first write of this run
            path.parent.mkdir(parents=True, exist_ok=True)
            keep = math.inf if self.keep_steps_up_to is None else self.keep_steps_up_to
            keep_metrics_up_to(path, keep)  # also drops a line cut short by a kill
            self._columns = read_metrics(path)[0] if path.is_file() else []
        exists = bool(self._columns)
        columns = sorted(set(self._columns).union(*self._rows))
        if exists and columns != self._columns:
            # A new column: the file is rewritten whole under the new header, atomically.
            _write_atomically(path, columns, read_metrics(path)[1])
        with open(path, "a" if exists else "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            if not exists:
                writer.writeheader()
            writer.writerows(self._rows)
            _fsync(handle)
        self._columns = columns
        self._rows = []

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()
