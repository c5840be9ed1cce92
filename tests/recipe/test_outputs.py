"""The learning-rate schedule, the curves plot, and the Dockerfile's references."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from bert_reduce.recipe.optim import warmup_cosine_schedule
from bert_reduce.recipe.plot import plot_metrics, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_warmup_cosine_schedule() -> None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = warmup_cosine_schedule(optimizer, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[14:] == pytest.approx([0.1] * 6)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        warmup_cosine_schedule(optimizer, 1, 10, min_lr_ratio=2.0)


def test_plot_from_lightning_csv(tmp_path: Path) -> None:
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text(
        "lr,step,train_loss,val_loss,val_ppl\n"
        "0.1,1,3.5,,\n0.1,2,3.2,,\n,2,,3.1,22.2\n0.1,3,3.0,,\n,3,,2.9,18.2\n"
    )
    series = read_metrics(csv_path)
    assert series["train_loss"] == [(1, 3.5), (2, 3.2), (3, 3.0)]
    assert series["val_ppl"] == [(2, 22.2), (3, 18.2)]
    png = plot_metrics(csv_path, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.csv").write_text("x,y\n1,2\n")
    with pytest.raises(KeyError, match="no 'step' column"):
        read_metrics(tmp_path / "bad.csv")


def test_dockerfile_copies_files_that_exist() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\S+-py3", dockerfile, re.MULTILINE)
    sources = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY"):
            args = [a for a in line.split()[1:] if not a.startswith("--")]
            sources += args[:-1]
    assert sources, "the Dockerfile copies nothing"
    for source in sources:
        assert (ROOT / source).exists(), source
    assert "train.py" in dockerfile.splitlines()[-1]  # the default command trains
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not any(source.rstrip("/") in ignored for source in sources)
