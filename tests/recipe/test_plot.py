from __future__ import annotations

from pathlib import Path

import pytest

from bert_reduce.recipe.plot import plot_metrics


def test_plot_from_lightning_csv(tmp_path: Path) -> None:
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text(
        "lr,step,train_loss,val_loss,val_ppl\n"
        "0.1,1,3.5,,\n0.1,2,3.2,,\n,2,,3.1,22.2\n0.1,3,3.0,,\n,3,,2.9,18.2\n"
    )
    png = plot_metrics(csv_path, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.csv").write_text("x,y\n1,2\n")
    with pytest.raises(ValueError, match="no 'step' column"):
        plot_metrics(tmp_path / "bad.csv", tmp_path / "bad.png")
