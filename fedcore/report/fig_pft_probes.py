"""FedPFT's probe figures: t-SNE maps of trained runs' features (Figs. 2, 3; kind ``run_tsne``) and τ's attention
weights (Fig. 6; kind ``attention``), drawn from ``fedcore.analysis.run_features``' files. A panel without data
says why (not configured, no such feature) instead of disappearing."""
from __future__ import annotations

import math
import os

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from fedcore.report.fig_probes import _class_colors
from fedcore.report.plotting import add_notes, mark_empty, missing_note, new_figure, set_caption

MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")
OK = "ok"


def build(kind: str, path: str | os.PathLike, fig_cfg: dict) -> Figure:
    """The figure of ``kind`` from its probe file (the caller's caption carries the scale's note)."""
    from fedcore.analysis.probe_files import ATTENTION_FORMAT, RUN_TSNE_FORMAT as TSNE_FORMAT, read_panels

    if kind == "run_tsne":
        return tsne_runs_figure(*read_panels(path, TSNE_FORMAT), fig_cfg)
    return attention_figure(*read_panels(path, ATTENTION_FORMAT), fig_cfg)


def _grid(n: int, cols: int, panel: tuple[float, float]):
    ncols = max(1, min(n, cols))
    fig, axes = new_figure(math.ceil(n / ncols), ncols, panel=panel)
    for ax in axes.ravel()[n:]:
        ax.set_visible(False)
    return fig, axes.ravel()


def _split_panels(axes, panels: list[dict]) -> tuple[list[tuple[int, object, dict]], list[tuple[str, str]]]:
    """Title every panel; mark those without data empty. Returns (index, axis, panel) of the drawable ones and
    (label, reason) of the others, for the figure's "Not drawn" note."""
    drawable, missing = [], []
    for i, (ax, p) in enumerate(zip(axes, panels)):
        ax.set_title(p["label"], fontsize="medium")
        if p["status"] == OK:
            drawable.append((i, ax, p))
        else:
            mark_empty(ax, p["status"])
            missing.append((p["label"], f"{p['method']}: {p['status']}"))
    return drawable, missing


def tsne_runs_figure(meta: dict, arrays: dict[str, np.ndarray], fig_cfg: dict) -> Figure:
    """One t-SNE panel per run: colour = class, marker = client; with ``centroids``, each client's class centroid
    (mean of its t-SNE points) drawn large (Fig. 3)."""
    panels = meta["panels"]
    fig, axes = _grid(len(panels), int(fig_cfg.get("cols", 4)), (3.6, 3.6))
    n_classes = max([int(arrays[f"labels_{i}"].max(initial=-1)) + 1 for i, p in enumerate(panels) if p["status"] == OK]
                    or [0])
    colors = _class_colors(max(n_classes, 1))
    n_clients = max([p.get("clients", 0) for p in panels] or [0])
    drawable, missing = _split_panels(axes, panels)
    for i, ax, _ in drawable:
        emb, labels, clients = arrays[f"emb_{i}"], arrays[f"labels_{i}"], arrays[f"clients_{i}"]
        for c in np.unique(clients):
            sel = clients == c
            ax.scatter(emb[sel, 0], emb[sel, 1], s=6, c=[colors[k] for k in labels[sel]],
                       marker=MARKERS[int(c) % len(MARKERS)], alpha=0.7, linewidths=0)
            if fig_cfg.get("centroids"):
                for k in np.unique(labels[sel]):
                    pts = emb[sel & (labels == k)]
                    ax.scatter(*pts.mean(axis=0), s=70, color=colors[k], marker=MARKERS[int(c) % len(MARKERS)],
                               edgecolors="black", linewidths=0.8)
        ax.set_xticks([])
        ax.set_yticks([])
    names = meta.get("class_names") or []
    handles = [Patch(color=colors[k], label=names[k] if k < len(names) else str(k)) for k in range(n_classes)]
    handles += [Line2D([], [], color="gray", marker=MARKERS[c % len(MARKERS)], linestyle="none",
                       label=f"client {c}") for c in range(n_clients)]
    if handles:
        fig.legend(handles=handles, loc="outside right center", fontsize="x-small", ncols=1 + len(handles) // 25)
    add_notes(fig, missing_note("Not drawn", missing))
    set_caption(fig, f"{fig_cfg.get('caption', '')}\nt-SNE perplexity {meta.get('perplexity')}, "
                     f"seed {meta.get('seed')}; every client's test images, its own model")
    return fig


def attention_figure(meta: dict, arrays: dict[str, np.ndarray], fig_cfg: dict) -> Figure:
    """One heatmap per run: rows = test samples of one client, columns = [f, p_1 .. p_n], value = attention
    weight of τ's output token (rows sum to 1)."""
    panels = meta["panels"]
    fig, axes = _grid(len(panels), int(fig_cfg.get("cols", 3)), (4.2, 3.6))
    drawable, missing = _split_panels(axes, panels)
    for i, ax, p in drawable:
        w = arrays[f"weights_{i}"]
        ax.set_title(f"{p['label']} ({w.shape[0]} images)", fontsize="medium")  # a client may hold fewer
        im = ax.imshow(w, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
        ax.set_xticks(range(w.shape[1]), ["f"] + [str(k) for k in range(1, w.shape[1])], fontsize="xx-small")
        ax.set_xlabel(f"input of τ: f, then {p['prompts']} prompts 1..{w.shape[1] - 1}", fontsize="x-small")
        ax.set_ylabel("test sample", fontsize="x-small")
        fig.colorbar(im, ax=ax, shrink=0.8)
    add_notes(fig, missing_note("Not drawn", missing))
    set_caption(fig, f"{fig_cfg.get('caption', '')}\nclient {meta.get('client')}, its first "
                     f"{meta.get('samples')} test images (fewer where it has fewer); weights averaged over heads")
    return fig
