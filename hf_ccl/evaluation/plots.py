"""Plots of a results matrix (matplotlib is imported only when a plot is drawn; install `hf_ccl[plots]`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from .matrix import INITIAL_LABEL, ResultsMatrix


def _rows_and_labels(matrix: ResultsMatrix) -> tuple[np.ndarray, list[str]]:
    rows: list[np.ndarray] = []
    labels: list[str] = []
    initial = matrix.initial_headline()
    if initial is not None:
        rows.append(initial)
        labels.append(INITIAL_LABEL)
    for row, values in zip(matrix.rows, matrix.headline(), strict=True):
        rows.append(values)
        labels.append(f"after {row.label}")
    data = np.stack(rows) if rows else np.empty((0, matrix.num_tasks))
    return data, labels


def plot_matrix_heatmap(
    matrix: ResultsMatrix, path: str | os.PathLike[str], title: str | None = None
) -> Path:
    """Save a heatmap of the headline matrix (rows: initial, after each task; columns: tasks) to `path`, on a fixed
    0-100 colour scale (the same colours across revisions and runs)."""
    figure = matrix_heatmap_figure(matrix, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(figure, path, dpi=120)
    return path


def save_png(figure: Any, path: Path, dpi: int) -> None:
    """Save a figure as PNG in one draw: `savefig` draws a figure with a layout engine twice (once to lay it out,
    once to paint it); the Agg canvas lays out and paints in one draw, to the same pixels (one tiny task's heatmap
    was most of its checkpoint's time)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    figure.set_dpi(dpi)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    width, height = canvas.get_width_height()
    Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1).save(path, format="PNG")


def matrix_heatmap_figure(matrix: ResultsMatrix, title: str | None = None) -> Any:
    """The `matplotlib.figure.Figure` that `plot_matrix_heatmap` saves."""
    from matplotlib.figure import Figure  # lazy: matplotlib is optional

    data, labels = _rows_and_labels(matrix)
    width = 1.6 + 1.1 * max(matrix.num_tasks, 1)
    height = 1.4 + 0.55 * max(len(labels), 1)
    figure = Figure(figsize=(width, height), layout="constrained")
    axes = figure.add_subplot()
    # A fixed 0-100 scale: the same score has the same colour in every revision and every run.
    image = axes.imshow(np.ma.masked_invalid(data), cmap="viridis", aspect="auto", vmin=0.0, vmax=100.0)
    axes.set_xticks(range(matrix.num_tasks), matrix.task_names, rotation=45, ha="right")
    axes.set_yticks(range(len(labels)), labels)
    axes.set_xlabel("evaluated on")
    for (i, j), value in np.ndenumerate(data):
        if not math.isnan(value):
            colour = "black" if value > 60.0 else "white"  # viridis is light above about 60 of 100
            axes.text(j, i, f"{value:.1f}", ha="center", va="center", color=colour, fontsize=8)
    figure.colorbar(image, ax=axes, label="headline metric (%)")
    axes.set_title(title or "results matrix")
    return figure
