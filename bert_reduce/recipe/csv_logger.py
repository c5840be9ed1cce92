"""``metrics.csv``: appended to by a resumed run, each step exactly once, never half-written.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when its writer is created,
rewrites the whole file in place when a new column appears (a kill then loses the file), and
does not sync it: hence :class:`AppendingCSVLogger` (docs/recipe.md, "Exactly-once rows").
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

from bert_reduce.recipe.files import write_atomically

METRICS_FILE = "metrics.csv"


def read_metrics(metrics_csv: Path) -> tuple[list[str], list[dict[str, str]], bool]:
    """The columns and whole rows of a ``metrics.csv`` (none if it is missing).

    Returns:
        The header, the rows (as ``csv.DictReader`` gives them), and whether a last line cut
        short (no final newline: a write interrupted by a kill) was left out.

    Raises:
        ValueError: If the file has no ``step`` column.
    """
    if not metrics_csv.is_file():
        return [], [], False
    text = metrics_csv.read_text()
    cut = bool(text) and not text.endswith("\n")
    reader = csv.DictReader(text[: text.rfind("\n") + 1].splitlines(keepends=True))
    rows = list(reader)
    fieldnames = list(reader.fieldnames or [])
    if "step" not in fieldnames:
        raise ValueError(
            f"{metrics_csv} has no 'step' column (columns: {fieldnames or None}): it was not "
            "written by train.py. Move it away to resume in this directory."
        )
    return fieldnames, rows, cut


def _write(path: Path, fieldnames: list[str], rows: list[dict[str, Any]]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fieldnames)
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, lambda file: file.write(text.getvalue().encode()))


def keep_metrics_up_to(metrics_csv: Path, step: float) -> int:
    """Drop the rows of ``metrics_csv`` after ``step`` and a line cut short; atomically.

    Args:
        metrics_csv: A ``metrics.csv``; nothing happens if it is missing.
        step: The optimizer steps of the checkpoint being resumed (``math.inf``: only drop a
            cut line).

    Returns:
        How many rows were dropped (a cut line counts as one).

    Raises:
        ValueError: If the file has no ``step`` column.
    """
    fieldnames, rows, cut = read_metrics(metrics_csv)
    kept = [row for row in rows if not row["step"] or float(row["step"]) <= step]
    if len(kept) < len(rows) or cut:
        _write(metrics_csv, fieldnames, kept)
    return len(rows) - len(kept) + cut


class AppendingCSVLogger(Logger):
    """Logs to ``<save_dir>/metrics.csv`` in ``CSVLogger``'s format (rank 0 only).

    Args:
        save_dir: The run directory.
        keep_steps_up_to: The step of the checkpoint this run resumes from: rows of later
            steps are dropped before the first new row is written (default: none).
    """

    def __init__(self, save_dir: str | os.PathLike[str], keep_steps_up_to: float = math.inf):
        super().__init__()
        self.metrics_file = Path(save_dir) / METRICS_FILE
        self.keep_steps_up_to = keep_steps_up_to
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] | None = None  # the file's header, once this run wrote

    name = version = ""  # type: ignore[assignment]  # no <name>/<version> subdirectories

    @property
    @override
    def save_dir(self) -> str:
        return str(self.metrics_file.parent)

    log_dir = save_dir  # type: ignore[assignment]

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the recipe writes the whole configuration to ``config.yaml``."""

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record one row: ``metrics`` and ``step`` (written at the next :meth:`save`)."""
        row = {k: v.item() if isinstance(v, Tensor) else v for k, v in metrics.items()}
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
            keep_metrics_up_to(path, self.keep_steps_up_to)
            self._columns = read_metrics(path)[0]
        columns = sorted(set(self._columns).union(*self._rows))
        if columns != self._columns:
            # A new file, or a new column: the file is written whole under the new header.
            _write(path, columns, read_metrics(path)[1] + self._rows)
        else:
            with open(path, "a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=columns).writerows(self._rows)
                handle.flush()
                os.fsync(handle.fileno())
        self._columns = columns
        self._rows = []

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()
