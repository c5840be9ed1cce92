"""``metrics.csv`` is appended to, and a resumed run replaces only the rows after its step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from bert_reduce.recipe.csv_logger import AppendingCSVLogger, keep_metrics_up_to
from tests.helpers.recipe_runs import rows

pytestmark = pytest.mark.lightning24  # also run under NeMo's Lightning 2.4 (.ci/run)

OLD = "lr,step,train_loss,val_loss,val_ppl\n0.1,1,3.5,,\n0.1,2,3.4,,\n,2,,3.3,27.1\n0.1,3,3.2,,\n"


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
    logger = AppendingCSVLogger(save_dir=tmp_path, keep_steps_up_to=2)
    assert logger.log_dir == str(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    logger.save()
    assert path.read_text() == OLD  # a resume that fails before its first row changes nothing
    logger.log_metrics({"train_loss": 3.25, "lr": 0.1, "grad_norm": 1.5}, step=3)
    logger.save()
    logged = rows(tmp_path)
    assert [(r["step"], r["train_loss"]) for r in logged] == [
        ("1", "3.5"), ("2", "3.4"), ("2", ""), ("3", "3.25"),
    ]  # fmt: skip
    assert logged[-1]["grad_norm"] == "1.5" and logged[0]["grad_norm"] == ""  # a new column
    logger.log_metrics({"train_loss": 3.0, "lr": 0.1}, step=4)
    logger.save()  # later writes append without truncating again
    assert [r["step"] for r in rows(tmp_path)] == ["1", "2", "2", "3", "4"]


def test_a_line_cut_by_a_kill_is_dropped_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(OLD + "0.1,4,3.1")  # step 4's row, cut before its end
    assert keep_metrics_up_to(path, math.inf) == 1
    assert path.read_text() == OLD
    path.write_text(OLD + "0.1,4,3.1")
    logger = AppendingCSVLogger(save_dir=tmp_path)  # not resuming: still no glued lines
    logger.log_metrics({"train_loss": 3.0, "lr": 0.1}, step=4)
    logger.save()
    assert path.read_text() == OLD + "0.1,4,3.0,,\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]  # no temporary file


def test_same_file_as_lightnings_csv_logger(tmp_path: Path) -> None:
    # Lightning's CSVLogger is the reference for the format: sorted columns, one row per call,
    # the header rewritten when a column appears (here val_loss, then grad_norm).
    calls = [
        ({"train_loss": 3.5, "lr": 0.1}, 1),
        ({"train_loss": 3.25, "lr": 0.1}, 2),
        ({"val_loss": 3.3, "val_ppl": 27.1}, 2),
        ({"train_loss": 3.0, "lr": 0.05, "grad_norm": 1.5}, 3),
    ]
    ours = AppendingCSVLogger(save_dir=tmp_path / "ours")
    lightnings = CSVLogger(save_dir=tmp_path / "lightning", name="", version="")
    for metrics, step in calls:
        for logger in (ours, lightnings):
            logger.log_metrics(metrics, step)
            logger.save()
    reference = (tmp_path / "lightning" / "metrics.csv").read_text()
    assert (tmp_path / "ours" / "metrics.csv").read_text() == reference
    assert reference.splitlines()[0] == "grad_norm,lr,step,train_loss,val_loss,val_ppl"
