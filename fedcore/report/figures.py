"""Accuracy-per-round figures: one panel per experiment, one line per method (mean ± std over seeds)."""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedcore.io import atomic_path
from fedcore.metrics import DIVERGED
from fedcore.report.plotting import add_notes, missing_note, set_caption
from fedcore.report.tables import (DIVERGED_MARK, MISSING_METRIC, MISSING_RUN, OK, PERCENT, cell_status, mark_notes,
                                   metric_factor, metric_key)

PNG_DPI = 150
PANEL_SIZE = (4.5, 3.4)  # inches per panel
METRIC_LABELS = {"global_acc": "global accuracy", "local_acc": "mean local accuracy",
                 "worst_local_acc": "worst local accuracy", "select_cluster_acc": "Select clustering accuracy",
                 "global_acc_min": "lowest client's accuracy", "global_acc_max": "highest client's accuracy",
                 "train_ce": "mean training L_CE", "train_con": "mean training L_Con"}


def curve(rows: pd.DataFrame, factor: float = PERCENT) -> pd.DataFrame:
    """Per round: mean and std (ddof=1) over seeds in the metric's unit (accuracies in %), and the number of seeds
    evaluated there."""
    stats = rows.groupby("round")["value"].agg(["mean", "std", "count"]).sort_index()
    stats[["mean", "std"]] *= factor
    return stats


def _metric_rows(metrics: pd.DataFrame, experiment: str, fig_cfg: dict) -> pd.DataFrame:
    """The rows of `metrics` that one panel plots."""
    split, client, metric = metric_key(fig_cfg)
    mask = ((metrics["experiment"] == experiment) & (metrics["split"] == split)
            & (metrics["client"] == client) & (metrics["metric"] == metric))
    return metrics.loc[mask]


def diverged_from(metrics: pd.DataFrame, experiment: str) -> dict[str, int]:
    """Per method of `experiment`: the first round at which some seed's trained state held NaN or inf (the
    engine's `diverged` rows); methods whose runs never diverged are absent."""
    rows = metrics.loc[(metrics["experiment"] == experiment) & (metrics["metric"] == DIVERGED)]
    return {m: int(r) for m, r in rows.groupby("method")["round"].min().items()}


def _methods_in_order(rows: pd.DataFrame, fig_cfg: dict, configured: list[str] | None) -> list[str]:
    """Methods to draw: fig_cfg's order when given, else sorted; only configured ones with rows."""
    present = set(rows["method"])
    if configured is not None:
        # Stale runs of a method dropped from the experiment must not reappear in the figure.
        present &= set(configured)
    order = fig_cfg.get("methods") or sorted(present)
    return [m for m in order if m in present]


def metric_label(fig_cfg: dict) -> str:
    """Axis label for the plotted metric."""
    if fig_cfg["metric"] == "client_acc":
        return f"client {fig_cfg['client']} local accuracy (%)"
    unit = " (%)" if metric_factor(fig_cfg) == PERCENT else ""
    return f"{METRIC_LABELS.get(fig_cfg['metric'], fig_cfg['metric'])}{unit}"


def method_colors(methods: list[str]) -> dict[str, tuple]:
    """One fixed colour per method, so a method looks the same in every panel."""
    cmap = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {m: cmap(i % cmap.N) for i, m in enumerate(methods)}


# Marker and dash per method (by position), so that curves lying on top of each other stay distinguishable.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
DASHES = ("-", "--", "-.", ":")


def method_style(index: int) -> dict[str, str]:
    """Marker and line style of the index-th method."""
    return {"marker": MARKERS[index % len(MARKERS)], "linestyle": DASHES[(index // 2) % len(DASHES)]}


def _select_scale(metrics: pd.DataFrame, scale: str | None) -> pd.DataFrame:
    """Keep one scale; refuse to mix scales in one figure."""
    if scale is not None:
        return metrics.loc[metrics["scale"] == scale]
    scales = sorted(set(metrics["scale"]))
    if len(scales) > 1:
        raise ValueError(f"metrics hold several scales {scales}; pass scale= to pick one")
    return metrics


def draw_panel(ax, rows: pd.DataFrame, experiment: str, fig_cfg: dict, colors: dict[str, tuple],
               configured: list[str] | None = None, diverged: dict[str, int] | None = None) -> None:
    """Draw one experiment's panel, or a visible 'no runs' note when there is nothing to plot. Lines carry the
    methods' display labels; the figure draws one legend for all panels. A method in `diverged` (first round)
    gets a dotted line there in its colour, topped by the tables' mark."""
    ax.set_title(experiment)
    ax.set_xlabel("round")
    ax.set_ylabel(metric_label(fig_cfg))
    methods = _methods_in_order(rows, fig_cfg, configured)
    if not methods:
        # An empty experiment stays in the figure, so its absence is visible rather than silent.
        ax.text(0.5, 0.5, "no runs", ha="center", va="center", transform=ax.transAxes, fontsize=14)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    order = list(colors)
    labels = fig_cfg.get("labels") or {}
    for method in methods:
        stats = curve(rows.loc[rows["method"] == method], metric_factor(fig_cfg))
        n_seeds = rows.loc[rows["method"] == method, "seed"].nunique()
        ax.plot(stats.index, stats["mean"], markersize=4, color=colors[method], linewidth=1.3,
                label=f"{labels.get(method, method)} (n={n_seeds})", **method_style(order.index(method)))
        band = stats["count"] > 1  # std is defined only where more than one seed was evaluated
        if band.any():
            ax.fill_between(stats.index[band], (stats["mean"] - stats["std"])[band],
                            (stats["mean"] + stats["std"])[band], color=colors[method], alpha=0.2)
        if method in (diverged or {}):  # the curve past this round scores a model holding NaN or inf
            ax.axvline(diverged[method], color=colors[method], linestyle=":", linewidth=1.2)
            ax.annotate(DIVERGED_MARK, (diverged[method], 0.98), xycoords=("data", "axes fraction"),
                        color=colors[method], ha="left", va="top", fontweight="bold")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)


def _configured_methods(panels: list[str], experiments: dict[str, dict] | None) -> dict[str, list[str]]:
    """Configured methods per panel, or {} (draw everything) when no experiment dicts are given."""
    if experiments is None:
        return {}
    unknown = [e for e in panels if e not in experiments]
    if unknown:
        raise ValueError(f"figure experiments {unknown} are not among the resolved experiments")
    return {e: list(experiments[e].get("methods", [])) for e in panels}


def undrawn(metrics: pd.DataFrame, rows: dict[str, pd.DataFrame], fig_cfg: dict,
            experiments: dict[str, dict] | None, implemented: set[str] | None) -> list[tuple[str, str]]:
    """(panel: method, reason) of every method the figure lists that has no curve in a panel, with the reason a
    table cell would give (not implemented, not configured, missing run, missing metric); without experiment
    dicts only missing runs and metrics can be told apart."""
    labels = fig_cfg.get("labels") or {}
    out = []
    for experiment, panel_rows in rows.items():
        exp_cfg = (experiments or {}).get(experiment)
        for method in fig_cfg.get("methods") or []:
            drawn = panel_rows.loc[panel_rows["method"] == method]
            run = metrics.loc[(metrics["experiment"] == experiment) & (metrics["method"] == method)]
            if exp_cfg is None:
                status = OK if len(drawn) else (MISSING_METRIC if len(run) else MISSING_RUN)
            else:
                status = cell_status(method, exp_cfg, run, drawn, implemented if implemented is not None else {method})
            if status != OK:
                out.append((f"{experiment}: {labels.get(method, method)}", status))
    return out


def make_figure(metrics: pd.DataFrame, fig_cfg: dict, scale: str | None = None,
                experiments: dict[str, dict] | None = None, implemented: set[str] | None = None) -> Figure:
    """Build (but do not save) the figure described by `fig_cfg`; a listed method without a curve in a panel is
    named under the figure with the reason (``implemented``: the methods with code, for 'not implemented')."""
    metrics = _select_scale(metrics, scale)
    panels = list(fig_cfg["experiments"])
    configured = _configured_methods(panels, experiments)
    n = max(len(panels), 1)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(PANEL_SIZE[0] * ncols, PANEL_SIZE[1] * nrows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without touching pyplot's global backend
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    rows = {e: _metric_rows(metrics, e, fig_cfg) for e in panels}
    all_methods = sorted(set().union(*(set(r["method"]) for r in rows.values())))
    colors = method_colors(fig_cfg.get("methods") or all_methods)
    # only methods drawn in the panel (configured, with rows): a stale run's divergence is no note of this figure
    diverged = {e: {m: r for m, r in diverged_from(metrics, e).items()
                    if m in _methods_in_order(rows[e], fig_cfg, configured.get(e))} for e in panels}
    for ax, experiment in zip(axes, panels):
        draw_panel(ax, rows[experiment], experiment, fig_cfg, colors, configured.get(experiment), diverged[experiment])
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    handles: dict[str, object] = {}  # one entry per label over all panels, in the configured order
    for ax in axes[:len(panels)]:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):  # matplotlib's unlabelled lines (the diverged rounds')
                handles.setdefault(line.get_label(), line)
    if handles:  # right of the panels (a legend inside a panel covers its curves), below the caption
        fig.legend(list(handles.values()), list(handles), loc="outside right center", fontsize="small")
    labels = fig_cfg.get("labels") or {}
    gone = [f"{e}: {labels.get(m, m)} from round {r}" for e in panels for m, r in diverged[e].items()]
    add_notes(fig, missing_note("Not drawn", undrawn(metrics, rows, fig_cfg, experiments, implemented))
              + ([f"Diverged (dotted line): {'; '.join(gone)}."] + mark_notes(DIVERGED_MARK) if gone else []))
    set_caption(fig, fig_cfg.get("caption", ""))
    return fig


def plot_accuracy_per_round(metrics: pd.DataFrame, fig_cfg: dict, out_png: str | os.PathLike,
                            out_pdf: str | os.PathLike, scale: str | None = None,
                            experiments: dict[str, dict] | None = None) -> None:
    """Write the accuracy-per-round figure as PNG (dpi 150) and PDF, both atomically.

    `scale` picks one scale when the metrics hold several; `experiments` (resolved experiment dicts),
    when given, limits each panel to the experiment's configured methods.
    """
    fig = make_figure(metrics, fig_cfg, scale, experiments)
    # Both files are renamed into place only if both renders succeed.
    with contextlib.ExitStack() as stack:
        png = stack.enter_context(atomic_path(Path(out_png)))
        pdf = stack.enter_context(atomic_path(Path(out_pdf)))
        fig.savefig(png, format="png", dpi=PNG_DPI, metadata={"Software": None})
        # No creation date, so reruns on the same data give the same bytes.
        fig.savefig(pdf, format="pdf", metadata={"CreationDate": None, "Producer": None})
