"""A PNG of the loss and perplexity curves from a run's ``metrics.csv``."""

from __future__ import annotations

import csv
import os
from pathlib import Path

__all__ = ["plot_metrics", "read_metrics"]


def read_metrics(path: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """The ``(step, value)`` points of every metric column of a Lightning ``metrics.csv``.

    Args:
        path: A CSV written by ``lightning.pytorch.loggers.CSVLogger`` (a ``step`` column and
            one column per metric, empty where a row does not log it).

    Returns:
        Metric name to its points, in file order.

    Raises:
        KeyError: If the file has no ``step`` column.
    """
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise KeyError(f"{path} has no 'step' column; its columns are {reader.fieldnames}.")
        series: dict[str, list[tuple[int, float]]] = {
            name: [] for name in reader.fieldnames if name not in ("step", "epoch")
        }
        for row in reader:
            for name, points in series.items():
                if row[name] not in ("", None):
                    points.append((int(row["step"]), float(row[name])))
    return series


def plot_metrics(metrics_csv: str | os.PathLike[str], png: str | os.PathLike[str]) -> Path:
    """Plot ``train_loss`` and ``val_loss`` (left) and ``val_ppl`` (right) against the step.

    Uses matplotlib's non-interactive Agg backend, so no display is needed.

    Args:
        metrics_csv: The run's ``metrics.csv``.
        png: Where to write the figure.

    Returns:
        The path of the PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics(metrics_csv)
    figure, (loss_axis, ppl_axis) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for name, style in (("train_loss", "-"), ("val_loss", "o-")):
        points = series.get(name, [])
        if points:
            steps, values = zip(*points, strict=True)
            loss_axis.plot(steps, values, style, label=name, markersize=4)
    loss_axis.set(xlabel="optimizer step", ylabel="masked-token cross-entropy (nats)")
    loss_axis.legend()
    points = series.get("val_ppl", [])
    if points:
        steps, values = zip(*points, strict=True)
        ppl_axis.plot(steps, values, "o-", color="tab:green", markersize=4)
    ppl_axis.set(xlabel="optimizer step", ylabel="validation perplexity", title="val_ppl")
    path = Path(png)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
