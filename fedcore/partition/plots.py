"""Client x class heat maps of a partition (FedHPL Fig. 4 style), written as PNG and PDF."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the pipeline renders on cluster nodes without a display

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedcore.io import atomic_path


def _matrix(counts_df: pd.DataFrame, split: str, n_clients: int, n_classes: int) -> np.ndarray:
    """Dense client x class count matrix for one split (absent pairs are zero)."""
    m = np.zeros((n_clients, n_classes), dtype=np.int64)
    sub = counts_df[counts_df["split"] == split]
    m[sub["client"].to_numpy(), sub["class"].to_numpy()] = sub["count"].to_numpy()
    return m


def count_norm(matrices: list[np.ndarray]) -> Normalize:
    """One colour scale for count matrices: log for a wide range (skewed Dirichlet: 1 .. 5000), linear from 0 for
    near-uniform counts."""
    vmax = max([int(m.max()) for m in matrices] + [1])
    positive = [int(m[m > 0].min()) for m in matrices if (m > 0).any()]
    vmin = min(positive) if positive else 1
    return LogNorm(vmin=1, vmax=vmax) if vmax / vmin > 30 else Normalize(vmin=0, vmax=vmax)


def _draw(ax, m: np.ndarray, label: str, fig: Figure, norm: Normalize | None = None, colorbar: bool = True):
    """One heat-map panel (its own colour scale unless ``norm`` is given); zero cells stay white so sparse
    (pathological) partitions read clearly. Returns the image (for a shared colour bar)."""
    shown = np.ma.masked_equal(m, 0)
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm or count_norm([m]))
    ax.set_facecolor("white")
    ax.set_title(f"{label} (total {int(m.sum())})", fontsize=10)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    # integer ticks, thinned so 100 clients x 200 classes stays legible
    ax.xaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
    ax.tick_params(labelsize=7)
    if colorbar:
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="samples")
    return im


def class_heatmap_grid(panels: list[tuple[pd.DataFrame, str]], cols: int, split: str = "train") -> Figure:
    """One client x class heat map of ``split`` counts per (counts, label) panel, ``cols`` panels a row (FedHPL
    Fig. 4: three datasets x IID / Dir / Non-IID)."""
    rows = max(1, -(-len(panels) // cols))
    fig = Figure(figsize=(4.6 * cols, 3.4 * rows), layout="constrained")
    axes = np.atleast_2d(fig.subplots(rows, cols, squeeze=False))
    matrices = []
    for counts_df, _ in panels:
        n_clients = int(counts_df["client"].max()) + 1 if len(counts_df) else 1
        n_classes = int(counts_df["class"].max()) + 1 if len(counts_df) else 1
        matrices.append(_matrix(counts_df, split, n_clients, n_classes))
    norm = count_norm(matrices)  # one colour scale for every panel, so that equal colours mean equal counts
    im = None
    for ax, m, (_, label) in zip(axes.ravel(), matrices, panels):
        im = _draw(ax, m, label, fig, norm=norm, colorbar=False)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    if im is not None:
        kind = "log scale" if isinstance(norm, LogNorm) else "linear scale"
        fig.colorbar(im, ax=axes, fraction=0.025, pad=0.01, label=f"samples ({kind}, all panels)")
    return fig


def plot_class_heatmap(
    counts_df: pd.DataFrame,
    out_png: str | Path,
    out_pdf: str | Path,
    title: str,
    num_clients: int | None = None,
    num_classes: int | None = None,
    test_label: str = "test",
) -> None:
    """Write a client x class heat map of train counts (left) and test counts (right) as PNG and PDF."""
    required = {"client", "split", "class", "count"}
    if not required <= set(counts_df.columns):
        raise ValueError(f"counts_df needs columns {sorted(required)}, got {list(counts_df.columns)}")
    n_clients = num_clients or (int(counts_df["client"].max()) + 1 if len(counts_df) else 1)
    n_classes = num_classes or (int(counts_df["class"].max()) + 1 if len(counts_df) else 1)
    # panel size grows with the matrix, within bounds, so 10x10 and 100x200 both stay readable;
    # many classes make wide panels, which are then stacked instead of placed side by side
    w = float(np.clip(3.0 + 0.05 * n_classes, 4.0, 14.0))
    h = float(np.clip(2.0 + 0.05 * n_clients, 3.0, 7.0))
    stacked = n_classes > 40
    size = (w + 1.0, 2 * h + 1.0) if stacked else (2 * w + 1.0, h + 0.8)
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(2, 1) if stacked else fig.subplots(1, 2)
    _draw(axes[0], _matrix(counts_df, "train", n_clients, n_classes), "train", fig)
    _draw(axes[1], _matrix(counts_df, "test", n_clients, n_classes), test_label, fig)
    fig.suptitle(title, fontsize=12)
    for out, fmt in ((out_png, "png"), (out_pdf, "pdf")):
        with atomic_path(out, suffix=f".{fmt}") as tmp:
            fig.savefig(tmp, format=fmt, dpi=150)
