"""Helpers shared by the paper figures: a blank figure, visible notes on what is missing, labels that do not
collide, legends and ticks that cover no data, atomic PNG + PDF."""
from __future__ import annotations

import contextlib
import math
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Annotation
from matplotlib.transforms import Bbox

from fedcore.io import atomic_path
from fedcore.report.tables import OK, build_cell

PNG_DPI = 150
NOTE_COLOR = "tab:red"
NOTE_LINE_IN = 0.17  # inches per line of note text under the panels


def new_figure(nrows: int, ncols: int, panel: tuple[float, float] = (4.5, 3.4), **subplot_kw: Any) -> tuple[Figure, np.ndarray]:
    """A constrained-layout Agg figure (no pyplot global state) and its axes as a 2-D array."""
    fig = Figure(figsize=(panel[0] * ncols, panel[1] * nrows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return fig, axes


def add_notes(fig: Figure, notes: list[str], color: str = NOTE_COLOR) -> None:
    """Print `notes` (what is missing, and why: red) under the panels, reserving room so nothing overlaps; call it
    once per figure."""
    if not notes:
        return
    width = max(40, int(fig.get_figwidth() * 72 / 5.6))  # characters per line at the 'small' font size
    lines = [wrapped for note in notes for wrapped in textwrap.wrap(note, width=width)]
    height = fig.get_figheight()
    extra = NOTE_LINE_IN * len(lines) + 0.1
    fig.set_figheight(height + extra)
    frac = extra / (height + extra)
    fig.get_layout_engine().set(rect=(0.0, frac, 1.0, 1.0 - frac))
    fig.text(0.01, 0.01, "\n".join(lines), ha="left", va="bottom", fontsize="small", color=color)


def set_caption(fig: Figure, caption: str) -> None:
    """The figure's caption as its title, wrapped to the figure's width so that it is never cut off."""
    width = max(40, int(fig.get_figwidth() * 72 / 6.5))  # characters per line at the 'medium' font size
    lines = [w for part in caption.split("\n") for w in (textwrap.wrap(part, width=width) or [""])]
    fig.suptitle("\n".join(lines), fontsize="medium")


def figure_notes(fig: Figure) -> str:
    """All figure-level text (notes, titles) with line wrapping undone, for tests and logs."""
    return " ".join(" ".join(t.get_text().split()) for t in fig.texts)


def mark_empty(ax, text: str) -> None:
    """A panel with nothing to draw says so in large text instead of disappearing."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=12, color=NOTE_COLOR,
            wrap=True)
    # per-axes tick switches: set_xticks([]) would also strip the ticks of axes sharing this one's axis
    ax.tick_params(left=False, bottom=False, labelleft=False, labelbottom=False)


def missing_note(what: str, items: list[tuple[str, str]]) -> list[str]:
    """One note listing items (label, reason) that are not drawn; empty list when none."""
    if not items:
        return []
    return [f"{what}: " + "; ".join(f"{label} ({reason})" for label, reason in items)]


def save_figure(fig: Figure, out_png: str | os.PathLike, out_pdf: str | os.PathLike) -> None:
    """Write PNG (dpi 150) and PDF, both renamed into place only if both renders succeed."""
    with contextlib.ExitStack() as stack:
        png = stack.enter_context(atomic_path(Path(out_png)))
        pdf = stack.enter_context(atomic_path(Path(out_pdf)))
        fig.savefig(png, format="png", dpi=PNG_DPI, metadata={"Software": None})
        # no creation date, so reruns on the same data give the same bytes
        fig.savefig(pdf, format="pdf", metadata={"CreationDate": None, "Producer": None})


def run_value(metrics: pd.DataFrame, method: str, experiment: str, metric: str, experiments: dict[str, dict],
              scale: str, implemented: set[str]) -> dict[str, Any]:
    """One run's windowed metric in % (mean ± std over seeds) with its status, exactly as a table cell."""
    if experiment not in experiments:
        raise ValueError(f"unknown experiment {experiment!r}; known: {sorted(experiments)}")
    return build_cell(metrics, method, {"experiment": experiment, "metric": metric, "label": method},
                      experiments[experiment], scale, implemented)


def has_value(cell: dict[str, Any]) -> bool:
    """Whether a run_value cell holds a number."""
    return cell["status"] == OK and not math.isnan(cell["ours"])


def err(cell: dict[str, Any]) -> float:
    """The std to draw as an error bar (0 when there is one seed)."""
    std = cell["ours_std"]
    return 0.0 if std is None or math.isnan(std) else float(std)


def select_scale(metrics: pd.DataFrame, scale: str) -> pd.DataFrame:
    """Only this scale's rows."""
    return metrics.loc[metrics["scale"] == scale]


# Candidate label spots around a point, tried in this order: the 8 directions (right first, as a reader expects),
# on rings of growing distance (points beyond the marker's edge).
LABEL_DIRECTIONS = [(1, 0), (1, 1), (0, 1), (-1, 1), (-1, 0), (-1, -1), (0, -1), (1, -1)]
LABEL_RINGS_PT = (3.0, 12.0, 24.0, 40.0)
_HA = {1: "left", 0: "center", -1: "right"}
_VA = {1: "bottom", 0: "center", -1: "top"}


def _overlap(a: Bbox, b: Bbox) -> float:
    """Area (px²) shared by two boxes."""
    inter = Bbox.intersection(a, b)
    return 0.0 if inter is None else inter.width * inter.height


def place_labels(ax, xy: list[tuple[float, float]], labels: list[str | None], marker_pt: float | list[float] = 8.0,
                 fontsize: str = "small") -> list[Annotation]:
    """Label each point (data coordinates) so that no label covers another label or a marker (a None label: a
    marker to keep clear, not labelled).

    Greedy, in the order given: a label takes the first spot (right, diagonals, above, ... of its point, then
    farther out) whose box meets no label placed before, no marker and stays inside the axes; when none does,
    the spot with the least overlap. A label that sits away from its point gets a thin leader line; points on
    the same spot share one label. Call it
    last, once the figure's layout (caption, notes, legend) is final: spots are measured in display space."""
    fig = ax.figure
    fig.canvas.draw()  # settles the layout and the axis limits
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    sizes = np.broadcast_to(np.asarray(marker_pt, dtype=float), (len(xy),))
    centers = ax.transData.transform(np.asarray(xy, dtype=float).reshape(-1, 2))
    markers = [Bbox.from_bounds(cx - s * px_per_pt / 2, cy - s * px_per_pt / 2, s * px_per_pt, s * px_per_pt)
               for (cx, cy), s in zip(centers, sizes)]
    frame = ax.get_window_extent(renderer)
    # points drawn on the same spot (within a pixel) share one label, "A, B": two labels would each look as
    # if they named the one marker
    labels = list(labels)
    for i in range(len(labels)):
        for j in range(i):
            if labels[i] is not None and labels[j] is not None and np.abs(centers[i] - centers[j]).max() < 1.0:
                labels[j], labels[i] = f"{labels[j]}, {labels[i]}", None
                break
    placed: list[Bbox] = []
    out = []
    for (x, y), size, text in zip(xy, sizes, labels):
        if text is None:
            continue
        best = None
        for ring, gap in enumerate(LABEL_RINGS_PT):
            for dx, dy in LABEL_DIRECTIONS:
                reach = size / 2 + gap
                ann = ax.annotate(text, (x, y), xytext=(dx * reach, dy * reach), textcoords="offset points",
                                  ha=_HA[dx], va=_VA[dy], fontsize=fontsize)
                box = ann.get_window_extent(renderer)
                ann.remove()
                inside = Bbox.intersection(box, frame)
                outside = box.width * box.height - (0.0 if inside is None else inside.width * inside.height)
                cost = sum(_overlap(box, b) for b in placed + markers) + 10.0 * outside
                if best is None or cost < best[0]:
                    best = (cost, ring, (dx * reach, dy * reach), dx, dy, box)
                if cost == 0.0:
                    break
            if best[0] == 0.0:
                break
        _, ring, offset, dx, dy, box = best
        arrow = dict(arrowstyle="-", color="gray", linewidth=0.6, shrinkA=0, shrinkB=size / 2) if ring > 0 else None
        ann = ax.annotate(text, (x, y), xytext=offset, textcoords="offset points", ha=_HA[dx], va=_VA[dy],
                          fontsize=fontsize, arrowprops=arrow)
        ann.set_in_layout(False)  # the layout stays the one the spots were measured in
        placed.append(box)
        out.append(ann)
    return out


def outside_legend(ax, **kwargs: Any) -> None:
    """The axes' legend to its right, outside the plot, so it never covers data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="small", **kwargs)


def tick_at_values(axis, values) -> None:
    """Ticks at the given setting values only (a sweep's discrete settings), labelled without trailing zeros."""
    vals = sorted({float(v) for v in values})
    if vals:
        axis.set_ticks(vals, [f"{v:g}" for v in vals])
