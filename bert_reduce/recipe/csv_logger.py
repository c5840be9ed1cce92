"""``metrics.csv`` that a resumed run appends to, each step exactly once.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` as soon as its writer is created
(``lightning/fabric/loggers/csv_logs.py``, ``_ExperimentWriter._check_log_dir_exists``), and a
fresh writer knows no columns, so appending new columns to an old file fails. Here the writer
starts from the existing file's header and appends. A run resumed from step ``k`` first drops
the rows after step ``k`` (the interrupted run wrote them after its checkpoint, and the
resumed run writes them again), at its first write, so a resume that fails to start changes
nothing. Whether a run may write into a directory that holds a ``metrics.csv`` at all is
decided before, by :mod:`bert_reduce.recipe.run_directory`.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

__all__ = ["AppendingCSVLogger", "keep_metrics_up_to"]


def keep_metrics_up_to(metrics_csv: Path, step: int) -> int:
    """Drop the rows of ``metrics_csv`` logged after ``step``; the file is replaced atomically.

    Args:
        metrics_csv: A ``metrics.csv`` with a ``step`` column; nothing happens if it is
            missing.
        step: The optimizer steps done in the checkpoint being resumed.

    Returns:
        How many rows were dropped.

    Raises:
        ValueError: If the file has no ``step`` column.
    """
    if not metrics_csv.is_file():
        return 0
    with open(metrics_csv, newline="") as handle:
        reader = csv.DictReader(handle)
        fieldnames = reader.fieldnames
        rows = list(reader)
    if fieldnames is None or "step" not in fieldnames:
        raise ValueError(
            f"{metrics_csv} has no 'step' column (columns: {fieldnames}): it was not written by "
            "train.py. Move it away to resume in this directory."
        )
    kept = [row for row in rows if not row["step"] or float(row["step"]) <= step]
    if len(kept) == len(rows):
        return 0
    temporary = metrics_csv.with_name(metrics_csv.name + f".tmp-{os.getpid()}")
    with open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(kept)
    os.replace(temporary, metrics_csv)
    return len(rows) - len(kept)


class _AppendingExperimentWriter(ExperimentWriter):
    """Appends to an existing ``metrics.csv``, keeping its columns and its rows up to a step."""

    def __init__(self, log_dir: str, keep_steps_up_to: int | None) -> None:
        self.keep_steps_up_to = keep_steps_up_to
        super().__init__(log_dir)

    @override
    def _check_log_dir_exists(self) -> None:
        # Lightning deletes metrics.csv here; this writer keeps it and learns its columns.
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = sorted(next(csv.reader(handle), []))

    @override
    def save(self) -> None:
        if self.metrics and self.keep_steps_up_to is not None:
            keep_metrics_up_to(Path(self.metrics_file_path), self.keep_steps_up_to)
            self.keep_steps_up_to = None
        super().save()


class AppendingCSVLogger(CSVLogger):
    """A ``CSVLogger`` that appends to an existing ``metrics.csv``.

    Args:
        args: ``CSVLogger``'s.
        keep_steps_up_to: The step of the checkpoint this run resumes from: rows of later
            steps are dropped before the first new row is written. ``None``: keep every row.
        kwargs: ``CSVLogger``'s.
    """

    def __init__(
        self, *args: object, keep_steps_up_to: int | None = None, **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.keep_steps_up_to = keep_steps_up_to

    @property
    @override
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingExperimentWriter(self.log_dir, self.keep_steps_up_to)
        return self._experiment
