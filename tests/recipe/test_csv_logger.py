"""``metrics.csv`` is appended to, and a resumed run replaces only the rows after its step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from bert_reduce.recipe.csv_logger import AppendingCSVLogger, keep_metrics_up_to

OLD = "lr,step,train_loss,val_loss,val_ppl\n0.1,1,3.5,,\n0.1,2,3.4,,\n,2,,3.3,27.1\n0.1,3,3.2,,\n"


def read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_keep_metrics_up_to_drops_only_later_rows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(OLD)
    assert keep_metrics_up_to(path, 2) == 1
    assert path.read_text() == OLD.rsplit("0.1,3", 1)[0]  # the rest byte-identical
    assert keep_metrics_up_to(path, 2) == 0
    assert keep_metrics_up_to(tmp_path / "missing.csv", 2) == 0
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no 'step' column"):
        keep_metrics_up_to(tmp_path / "other.csv", 1)


def test_logger_appends_and_truncates_at_its_first_write(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(OLD)
    logger = AppendingCSVLogger(save_dir=tmp_path, name="", version="", keep_steps_up_to=2)
    assert logger.experiment is not None  # Lightning's CSVLogger deletes metrics.csv here
    assert path.read_text() == OLD  # a resume that fails before its first row changes nothing
    logger.log_metrics({"train_loss": 3.25, "lr": 0.1, "grad_norm": 1.5}, step=3)
    logger.save()
    rows = read(path)
    assert [(r["step"], r["train_loss"]) for r in rows] == [
        ("1", "3.5"), ("2", "3.4"), ("2", ""), ("3", "3.25"),
    ]  # fmt: skip
    assert rows[-1]["grad_norm"] == "1.5" and rows[0]["grad_norm"] == ""  # a new column
    logger.log_metrics({"train_loss": 3.0, "lr": 0.1}, step=4)
    logger.save()  # later writes append without truncating again
    assert [r["step"] for r in read(path)] == ["1", "2", "2", "3", "4"]
