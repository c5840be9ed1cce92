"""A PNG of the loss and perplexity curves from a run's ``metrics.csv``."""

from __future__ import annotations

import os
from pathlib import Path

from bert_reduce.recipe.csv_logger import read_metrics


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

    _, rows, _ = read_metrics(Path(metrics_csv))
    figure, (loss_axis, ppl_axis) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    curves = [
        (loss_axis, "train_loss", "-", {"label": "train_loss"}),
        (loss_axis, "val_loss", "o-", {"label": "val_loss"}),
        (ppl_axis, "val_ppl", "o-", {"color": "tab:green"}),
    ]
    for axis, name, style, options in curves:
        points = [(int(row["step"]), float(row[name])) for row in rows if row.get(name)]
        if points:
            steps, values = zip(*points, strict=True)
            axis.plot(steps, values, style, markersize=4, **options)
    loss_axis.set(xlabel="optimizer step", ylabel="masked-token cross-entropy (nats)")
    loss_axis.legend()
    ppl_axis.set(xlabel="optimizer step", ylabel="validation perplexity", title="val_ppl")
    path = Path(png)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
