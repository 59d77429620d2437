"""Paper figures drawn from the aggregated metrics: method scatter (SGPT Fig. 1), per-group selection counts
(Fig. 3) and sweeps of one setting (Figs. 4 and 6b).

Every value is a run's windowed metric computed exactly like a table cell (mean over seeds of the report
window, in %). A method or setting without a number is never dropped silently: it is listed under the
plot with the reason (not implemented, not configured, missing run, missing metric), and sweeps mark its
position with a grey ×.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from fedcore.report.figures import metric_label
from fedcore.report.plotting import (
    add_notes, err, has_value, mark_empty, missing_note, new_figure, outside_legend, place_labels, run_value,
    set_caption, tick_at_values,
)
from fedcore.report.tables import OK, cell_marks, cell_status, mark_notes, run_rows
from fedcore.selection import replace_experiment

GFL_COLOR, PFL_COLOR, UNKNOWN_COLOR, OURS_COLOR = "tab:blue", "tab:orange", "tab:gray", "tab:red"
MISSING_MARK = dict(marker="x", color="tab:gray", markersize=8, linestyle="none")


def _label(fig_cfg: dict, method: str) -> str:
    """A method's display label (config `labels`, filled from the report's labels and the variants')."""
    return (fig_cfg.get("labels") or {}).get(method, method)


def _axis_label(metric: str) -> str:
    """Axis label of a windowed metric."""
    return metric_label({"metric": metric})


# ----------------------------------------------------------------------------------------------
# Fig. 1: one point per method
# ----------------------------------------------------------------------------------------------

def scatter_points(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                   implemented: set[str]) -> pd.DataFrame:
    """Per method: x, y (in %), their stds and the status (ok, or why there is no point)."""
    rows = []
    for m in fig_cfg["methods"]:
        x = run_value(metrics, m, fig_cfg["experiment"], fig_cfg["x_metric"], experiments, scale, implemented)
        y = run_value(metrics, m, fig_cfg["experiment"], fig_cfg["y_metric"], experiments, scale, implemented)
        status = OK if has_value(x) and has_value(y) else (x["status"] if not has_value(x) else y["status"])
        rows.append({"method": m, "x": x["ours"], "y": y["ours"], "x_std": err(x), "y_std": err(y),
                     "n_seeds": min(x["n_seeds"], y["n_seeds"]), "status": status,
                     "marks": _marks(x, y) if status == OK else ""})
    return pd.DataFrame(rows)


def _marks(*cells: dict[str, Any]) -> str:
    """The marks (a table cell's † ‡ § ¶) of the cells a drawn point reads, each once."""
    return "".join(dict.fromkeys("".join(cell_marks(c) for c in cells)))


def _marker(method: str, highlight: str | None, personalized: dict[str, bool | None]) -> dict[str, Any]:
    """The highlighted method a star, PFL squares, GFL circles, unknown diamonds."""
    if method == highlight:
        return dict(marker="*", s=300, color=OURS_COLOR, zorder=4)
    kind = personalized.get(method)
    return dict(marker={True: "s", False: "o"}.get(kind, "D"), s=60,
                color={True: PFL_COLOR, False: GFL_COLOR}.get(kind, UNKNOWN_COLOR), zorder=3)


def _scatter_panel(ax, xy: dict[str, tuple[float, float, float, float]], fig_cfg: dict, highlight: str | None,
                   personalized: dict[str, bool | None]) -> tuple[list, list, list]:
    """Draw one marker per method (x, y, x_std, y_std); returns the spots, their sizes and labels for place_labels."""
    spots, sizes, labels = [], [], []
    for m, (x, y, x_std, y_std) in xy.items():
        style = _marker(m, highlight, personalized)
        if x_std or y_std:
            ax.errorbar(x, y, xerr=x_std, yerr=y_std, fmt="none", ecolor=style["color"], alpha=0.5)
        ax.scatter([x], [y], edgecolors="black", linewidths=0.5, **style)
        spots.append((x, y))
        sizes.append(math.sqrt(style["s"]))
        labels.append(_label(fig_cfg, m))
    ax.set_xlabel(_axis_label(fig_cfg["x_metric"]))
    ax.set_ylabel(_axis_label(fig_cfg["y_metric"]))
    ax.grid(True, alpha=0.3)
    return spots, sizes, labels


def coinciding(xy: dict[str, tuple[float, ...]], fig_cfg: dict, decimals: int = 2) -> list[str]:
    """A note per group of methods drawn on one spot (equal numbers as shown), so that one label for several
    methods is never mistaken for a missing one."""
    spots: dict[tuple[float, float], list[str]] = {}
    for m, v in xy.items():
        spots.setdefault((round(v[0], decimals), round(v[1], decimals)), []).append(_label(fig_cfg, m))
    return [f"{' and '.join(ms)} lie on one spot ({x:.{decimals}f}, {y:.{decimals}f}): equal numbers on both axes."
            for (x, y), ms in spots.items() if len(ms) > 1]


def scatter_figure(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                   implemented: set[str], personalized: dict[str, bool | None] | None = None) -> Figure:
    """SGPT Fig. 1: x/y metrics of each method; the highlighted method a star, PFL squares, GFL circles. At scale
    paper the paper's points are drawn over ours (dotted lines join each pair); at another scale, whose numbers are
    not comparable, the paper's points get a panel of their own beside ours."""
    personalized = personalized or {}
    paper = fig_cfg.get("paper") or {}
    beside = bool(paper) and scale != "paper"
    fig, axes = new_figure(1, 2 if beside else 1, panel=(5.4, 4.6) if beside else (7.5, 4.6))
    ax = axes[0, 0]
    points = scatter_points(metrics, fig_cfg, experiments, scale, implemented)
    highlight = fig_cfg.get("highlight")
    ours = {p.method: (p.x, p.y, p.x_std, p.y_std) for p in points.loc[points["status"] == OK].itertuples()}
    spots, sizes, labels = _scatter_panel(ax, ours, fig_cfg, highlight, personalized)
    marks = dict(zip(points["method"], points["marks"]))
    labels = [label + marks[m] for label, m in zip(labels, ours)]  # a point's marks, as its table cell's
    if scale == "paper" and paper:
        xy = np.array([paper[m] for m in fig_cfg["methods"] if m in paper], dtype=float)
        ax.scatter(xy[:, 0], xy[:, 1], marker="o", s=50, facecolors="none", edgecolors="black", alpha=0.6, zorder=2)
        for m, (x, y, _, _) in ours.items():  # dotted: our point -> the paper's
            if m in paper:
                ax.plot([x, paper[m][0]], [y, paper[m][1]], ":", color="gray", linewidth=0.8)
        spots += [tuple(v) for v in xy]
        sizes += [math.sqrt(50)] * len(xy)
        labels += [None] * len(xy)   # the paper's circles are obstacles, not labelled
    if not ours:
        mark_empty(ax, "no runs")
    data = (experiments.get(fig_cfg["experiment"]) or {}).get("dataset", "")
    if beside:
        ax.set_title(f"ours: scale {scale}" + (f", {data}" if data else ""), fontsize=10)
        theirs = {m: (v[0], v[1], 0.0, 0.0) for m, v in paper.items() if m in fig_cfg["methods"]}
        paper_spots = _scatter_panel(axes[0, 1], theirs, fig_cfg, highlight, personalized)
        axes[0, 1].set_title("the paper's numbers (a layout reference at this scale)", fontsize=10)
    handles = [Line2D([], [], marker="o", color=GFL_COLOR, ls="none", label="GFL (one global model)"),
               Line2D([], [], marker="s", color=PFL_COLOR, ls="none", label="PFL (personalised models)")]
    if highlight:
        handles.append(Line2D([], [], marker="*", color=OURS_COLOR, markersize=14, ls="none",
                              label=_label(fig_cfg, highlight)))
    if scale == "paper" and paper:
        handles.append(Line2D([], [], marker="o", markerfacecolor="none", color="black", ls="none", label="paper"))
    outside_legend(axes[0, -1], handles=handles)
    missing = [(_label(fig_cfg, p.method), p.status) for p in points.itertuples() if p.status != OK]
    add_notes(fig, missing_note("Not drawn", missing) + coinciding(ours, fig_cfg)
              + mark_notes("".join(marks[m] for m in ours)))
    set_caption(fig, fig_cfg.get("caption", ""))
    # last: the spots are measured in the final layout
    place_labels(ax, spots, labels, marker_pt=sizes)
    if beside:
        place_labels(axes[0, 1], paper_spots[0], paper_spots[2], marker_pt=paper_spots[1])
    return fig


# ----------------------------------------------------------------------------------------------
# Fig. 3: per-group selection counts of one client over the rounds
# ----------------------------------------------------------------------------------------------

SELECT_PREFIX = "select_g"


def selection_stats(metrics: pd.DataFrame, experiment: str, exp_cfg: dict, method: str, client: int, scale: str,
                    implemented: set[str]) -> tuple[pd.DataFrame | None, dict[str, Any]]:
    """Per group: mean and std (ddof=1) over rounds of the client's selection count, for the lowest seed.

    Returns (stats with columns group, mean, std; or None) and info {status, seed, rounds}.
    """
    run = run_rows(metrics, experiment, exp_cfg, method, scale)
    rows = run.loc[(run["split"] == "train") & (run["client"] == client)
                   & run["metric"].str.startswith(SELECT_PREFIX)]
    status = cell_status(method, exp_cfg, run, rows, implemented)
    if status != OK:
        return None, {"status": status, "seed": None, "rounds": 0}
    seed = int(rows["seed"].min())  # "one example client": one run, not a pool over partitions
    rows = rows.loc[rows["seed"] == seed]
    wide = rows.pivot_table(index="round", columns="metric", values="value", aggfunc="first")
    stats = pd.DataFrame({"group": [int(c[len(SELECT_PREFIX):]) for c in wide.columns],
                          "mean": wide.mean(axis=0).to_numpy(), "std": wide.std(axis=0, ddof=1).to_numpy()})
    return stats.sort_values("group").reset_index(drop=True), {"status": OK, "seed": seed, "rounds": len(wide)}


def selection_figure(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                     implemented: set[str]) -> Figure:
    """SGPT Fig. 3: one panel per run, bars = mean selections per group over rounds, error bars = std."""
    panels = fig_cfg["panels"]
    client = int(fig_cfg.get("client", 0))
    exp = fig_cfg["experiment"]
    fig, axes = new_figure(1, len(panels), panel=(5.0, 3.6), sharey=True)
    missing = []
    for ax, panel, color in zip(axes[0], panels, ("tab:orange", "tab:blue", "tab:green", "tab:purple")):
        label = _label(fig_cfg, panel["method"])
        stats, info = selection_stats(metrics, exp, experiments[exp], panel["method"], client, scale, implemented)
        if stats is None:
            ax.set_title(f"{panel['label']}\n{label}")
            mark_empty(ax, f"no selection counts\n({info['status']})")
            missing.append((f"{panel['label']}: {label}", info["status"]))
            continue
        yerr = stats["std"].fillna(0.0).to_numpy()
        ax.bar(stats["group"], stats["mean"], yerr=yerr, capsize=3, color=color, edgecolor="black", linewidth=0.5)
        mean_std = float(stats["std"].mean()) if stats["std"].notna().any() else math.nan
        ax.set_title(f"{panel['label']}\n{label}: client {client}, seed {info['seed']}, {info['rounds']} rounds")
        ax.text(0.98, 0.96, f"mean std = {mean_std:.1f}", transform=ax.transAxes, ha="right", va="top",
                fontsize="small")
        ax.set_xlabel("group g")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("selections per round (train samples)")
    add_notes(fig, missing_note("Not drawn", missing))
    set_caption(fig, fig_cfg.get("caption", ""))
    return fig


# ----------------------------------------------------------------------------------------------
# Figs. 4 and 6b: windowed metrics of runs that differ in one setting
# ----------------------------------------------------------------------------------------------

def sweep_points(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                 implemented: set[str]) -> pd.DataFrame:
    """One row per (series, setting): value, method, y (in %), std, n_seeds and status; a point reads its own
    ``experiment`` when it names one (a setting of the data), else the figure's."""
    rows = []
    for i, series in enumerate(fig_cfg["series"]):
        for p in sorted(series["points"], key=lambda q: q["value"]):
            cell = run_value(metrics, p["method"], p.get("experiment", fig_cfg["experiment"]), series["metric"],
                             experiments, scale, implemented)
            rows.append({"series": i, "value": float(p["value"]), "method": p["method"], "y": cell["ours"],
                         "std": err(cell), "n_seeds": cell["n_seeds"],
                         "status": OK if has_value(cell) else cell["status"],
                         "marks": _marks(cell) if has_value(cell) else ""})
    return pd.DataFrame(rows, columns=["series", "value", "method", "y", "std", "n_seeds", "status", "marks"])


def best_baselines(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                   implemented: set[str]) -> dict[str, tuple[str, float] | None]:
    """Per series metric: (method, value in %) of the best baseline with a number, or None."""
    out: dict[str, tuple[str, float] | None] = {}
    for metric in dict.fromkeys(s["metric"] for s in fig_cfg["series"]):
        best = None
        for m in fig_cfg.get("baselines", []):
            cell = run_value(metrics, m, fig_cfg["experiment"], metric, experiments, scale, implemented)
            if has_value(cell) and (best is None or cell["ours"] > best[1]):
                best = (m, float(cell["ours"]))
        out[metric] = best
    return out


def sweep_figure(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                 implemented: set[str]) -> Figure:
    """SGPT Figs. 4/6b: one line per series over the swept setting; optional reference and best-baseline lines."""
    on_y = fig_cfg.get("param_axis", "x") == "y"
    fig, axes = new_figure(1, 1, panel=(8.5, 4.4))  # wide enough for the legend at the right
    ax = axes[0, 0]
    points = sweep_points(metrics, fig_cfg, experiments, scale, implemented)
    # grey × at a missing setting, on the accuracy axis' lower edge
    edge = ax.get_yaxis_transform() if on_y else ax.get_xaxis_transform()
    missing, no_baseline = [], []
    for i, series in enumerate(fig_cfg["series"]):
        color = series.get("color", f"C{i}")
        pts = points.loc[points["series"] == i]
        ok = pts.loc[pts["status"] == OK]
        if len(ok):
            acc, val = ok["y"].to_numpy(dtype=float), ok["value"].to_numpy(dtype=float)
            xs, ys = (acc, val) if on_y else (val, acc)
            err_kw = {"xerr" if on_y else "yerr": ok["std"].to_numpy(dtype=float)}
            ax.errorbar(xs, ys, **err_kw, marker="o", color=color, capsize=3, label=series["label"])
            for x, y, m in zip(xs, ys, ok["marks"]):
                if m:  # the point's marks beside it, as its table cell's
                    ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), color=color, fontsize="small")
        for p in pts.loc[pts["status"] != OK].itertuples():
            ax.plot(*((0.02, p.value) if on_y else (p.value, 0.02)), transform=edge, **MISSING_MARK)
            missing.append((f"{series['label']} at {p.value:g} ({_label(fig_cfg, p.method)})", p.status))
        if scale == "paper" and series.get("paper"):
            for pp in series["paper"]:
                xy = (pp["y"], pp["value"]) if on_y else (pp["value"], pp["y"])
                ax.scatter(*xy, marker="D", s=60, facecolors="none", edgecolors=color, zorder=4,
                           label=f"paper: {series['label']}")
    if fig_cfg.get("reference") is not None:
        line = ax.axhline if on_y else ax.axvline
        line(fig_cfg["reference"], color="black", linestyle="--", linewidth=1,
             label=f"{fig_cfg['param_label']} = {fig_cfg['reference']:g}")
    if fig_cfg.get("baselines"):
        colors = {s["metric"]: s.get("color", f"C{i}") for i, s in enumerate(fig_cfg["series"])}
        for metric, best in best_baselines(metrics, fig_cfg, experiments, scale, implemented).items():
            if best is None:
                no_baseline.append((f"best-baseline line for {_axis_label(metric)}", "no baseline run has a number"))
                continue
            line = ax.axvline if on_y else ax.axhline
            line(best[1], color=colors[metric], linestyle="--", linewidth=1, alpha=0.8,
                 label=f"best baseline, {metric_label({'metric': metric}).removesuffix(' (%)')}: "
                       f"{_label(fig_cfg, best[0])} {best[1]:.2f}")
    if not (points["status"] == OK).any():
        mark_empty(ax, "no runs")
        # the settings keep their tick labels: they tell where each grey × of a missing run sits
        ax.tick_params(**({"left": True, "labelleft": True} if on_y else {"bottom": True, "labelbottom": True}))
    acc_label = (_axis_label(fig_cfg["series"][0]["metric"]) if len({s["metric"] for s in fig_cfg["series"]}) == 1
                 else "accuracy (%)")
    ax.set_xlabel(acc_label if on_y else fig_cfg["param_label"])
    ax.set_ylabel(fig_cfg["param_label"] if on_y else acc_label)
    # the settings are discrete: a tick at each one swept, none in between
    tick_at_values(ax.yaxis if on_y else ax.xaxis, points["value"])
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        outside_legend(ax)
    add_notes(fig, missing_note("Missing (grey ×)", missing) + missing_note("Not drawn", no_baseline)
              + mark_notes("".join(points["marks"])))
    set_caption(fig, fig_cfg.get("caption", ""))
    return fig



# ----------------------------------------------------------------------------------------------
# FedHPL Figs. 5, 6 (10): per-class accuracy of each method at the final round, one panel per experiment
# ----------------------------------------------------------------------------------------------

CLASS_PREFIX = "acc_class"


def class_accuracy(metrics: pd.DataFrame, experiment: str, exp_cfg: dict, method: str, scale: str,
                   implemented: set[str]) -> tuple[pd.Series | None, str]:
    """Per class: accuracy (%) at the run's last evaluated round, averaged over clients (client -1 rows) and
    seeds; or None and the reason (a run without ``evaluation.per_class`` has no such rows)."""
    run = run_rows(metrics, experiment, exp_cfg, method, scale)
    rows = run.loc[(run["split"] == "global") & (run["client"] == -1) & run["metric"].str.startswith(CLASS_PREFIX)]
    status = cell_status(method, exp_cfg, run, rows, implemented)
    if status != OK:
        return None, status
    last = rows.loc[rows["round"] == rows.groupby("seed")["round"].transform("max")]
    per = last.groupby("metric")["value"].mean() * 100.0
    per.index = [int(m[len(CLASS_PREFIX):]) for m in per.index]
    return per.sort_index(), OK


def per_class_lines(fig_cfg: dict, panel: dict) -> list[tuple[str, str, str, str]]:
    """A panel's lines as (key, label, method, experiment): one per ``methods`` entry in the panel's experiment,
    or one per ``lines`` entry, its method in the panel's experiment with ``experiment_replace: [old, new]``."""
    if "lines" not in fig_cfg:
        return [(m, _label(fig_cfg, m), m, panel["experiment"]) for m in fig_cfg["methods"]]
    return [(x["label"], x["label"], x["method"], replace_experiment(panel["experiment"], x.get("experiment_replace")))
            for x in fig_cfg["lines"]]


def per_class_figure(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                     implemented: set[str]) -> Figure:
    """One panel per experiment: x = class, y = final-round accuracy on that class's test images, one line per
    method or per configured line (missing ones are listed below the figure)."""
    panels = fig_cfg["panels"]
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = new_figure(nrows, ncols, panel=(4.6, 3.4), sharey=False)
    labels = {key: label for key, label, *_ in per_class_lines(fig_cfg, panels[0])}
    keys = list(labels)
    colors = {k: c for k, c in zip(keys, [f"C{i}" for i in range(len(keys))])}
    missing, drawn = [], set()
    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.set_visible(False)
            continue
        panel = panels[k]
        ax.set_title(panel["label"])
        any_line = False
        for key, label, m, exp in per_class_lines(fig_cfg, panel):
            per, status = class_accuracy(metrics, exp, experiments[exp], m, scale, implemented)
            if per is None:
                missing.append((f"{panel['label']}: {label}", status))
                continue
            ax.plot(per.index, per.to_numpy(), marker="o", ms=3, lw=1.2, color=colors[key], label=label)
            drawn.add(key)
            any_line = True
        if not any_line:
            mark_empty(ax, "no per-class accuracy")
        ax.set_xlabel("class")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    for row in axes:
        row[0].set_ylabel("final-round accuracy (%)")
    handles = [Line2D([], [], color=colors[k], marker="o", ms=3, label=labels[k]) for k in keys if k in drawn]
    if handles:  # right of the panels: inside one it covers that panel's lines
        fig.legend(handles=handles, loc="outside right center", fontsize="small")
    add_notes(fig, missing_note("Not drawn", missing))
    set_caption(fig, fig_cfg.get("caption", ""))
    return fig


# ----------------------------------------------------------------------------------------------
# FedHPL Figs. 3(c), 7-9: grouped bars, one group per column (experiment x metric), one bar per method
# ----------------------------------------------------------------------------------------------

def bars_figure(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                implemented: set[str]) -> Figure:
    """Grouped bars from the same cells a metrics table computes (``rows`` x ``columns``); a missing cell is a
    grey × on the axis and listed below the figure."""
    from fedcore.report.tables import build_table

    table = build_table(metrics, {**fig_cfg, "paper": fig_cfg.get("paper", {})}, experiments, scale, implemented)
    rows, cols = fig_cfg["rows"], fig_cfg["columns"]
    width = 0.8 / len(rows)
    fig, axes = new_figure(1, 1, panel=(max(6.0, 1.1 * len(cols) * max(1, len(rows) / 3)), 4.2))
    ax = axes[0, 0]
    missing = []
    for i, row in enumerate(rows):
        cells = table.loc[table["row"] == row].sort_values("col_index")
        xs = np.arange(len(cols)) + (i - (len(rows) - 1) / 2) * width
        ok = cells["status"].to_numpy() == OK
        label = (fig_cfg.get("row_labels") or {}).get(row) or _label(fig_cfg, row)
        if ok.any():  # a row without any bar gets no legend entry (an empty one shows another row's colour)
            ax.bar(xs[ok], cells["ours"].to_numpy(dtype=float)[ok], width, color=f"C{i}", label=label,
                   yerr=cells["ours_std"].fillna(0.0).to_numpy(dtype=float)[ok], capsize=2)
        for x, cell in zip(xs[ok], cells.loc[ok].itertuples()):
            marks = cell_marks(cell._asdict())
            if marks:  # the bar's marks on top, as its table cell's
                ax.annotate(marks, (x, cell.ours), textcoords="offset points", xytext=(0, 2), ha="center",
                            va="bottom", fontsize="small")
        for x, cell in zip(xs[~ok], cells.loc[~ok].itertuples()):
            ax.plot(x, 0.02, transform=ax.get_xaxis_transform(), **MISSING_MARK)
            missing.append((f"{cell.column}: {label}", cell.status))
    ax.set_xticks(np.arange(len(cols)), [c["label"] for c in cols])
    ax.set_ylabel(_axis_label(cols[0]["metric"]) if len({c["metric"] for c in cols}) == 1 else "accuracy (%)")
    ax.grid(True, axis="y", alpha=0.3)
    if not (table["status"] == OK).any():
        mark_empty(ax, "no runs")
        ax.tick_params(bottom=True, labelbottom=True)  # the column labels tell where each grey × sits
    if ax.get_legend_handles_labels()[0]:  # outside the axes: inside, it covers the tallest bars
        outside_legend(ax)
    drawn = table.loc[table["status"] == OK]
    add_notes(fig, missing_note("Missing (grey ×)", missing)
              + mark_notes("".join(cell_marks(c) for _, c in drawn.iterrows())))
    set_caption(fig, fig_cfg.get("caption", ""))
    return fig
