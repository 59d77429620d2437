"""Paper figures drawn from probe outputs and partitions: t-SNE maps (SGPT Fig. 5), congruence vs. key
momentum (Fig. 6a) and per-class client sample counts (Fig. 7). Missing values are listed under the plot."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator, MultipleLocator

from fedcore.report.plotting import (add_notes, mark_empty, missing_note, new_figure, outside_legend, set_caption,
                                     tick_at_values)

OK = "ok"
MISSING_MARK = dict(marker="x", color="tab:gray", markersize=8, linestyle="none")


def _class_colors(n: int) -> list[tuple]:
    """n colours, neighbouring classes always distinct (tab10/tab20, cycled beyond 20 classes)."""
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Fig. 5: t-SNE maps
# ----------------------------------------------------------------------------------------------

def tsne_figure(data: dict[str, Any], fig_cfg: dict) -> Figure:
    """One panel per configured block: the t-SNE map coloured by (coarse) class."""
    blocks = [int(b) for b in fig_cfg.get("blocks", data["blocks"])]  # prompt_tsne: the probe's one map
    ncols = min(len(blocks), 5)
    nrows = math.ceil(len(blocks) / ncols)
    fig, axes = new_figure(nrows, ncols, panel=(3.4, 3.4))
    labels = np.asarray(data["labels"])
    meta = data.get("meta", {})
    titles = meta.get("panel_titles")
    n_classes = int(labels.max(initial=-1)) + 1
    colors = _class_colors(max(n_classes, 1))
    missing = []
    for ax, b in zip(axes.ravel(), blocks):
        ax.set_title(titles[b] if titles else f"after block {b + 1} (index {b})", fontsize="medium")
        emb = data["embeddings"].get(b)
        if emb is None:
            mark_empty(ax, "not computed")
            missing.append((f"block index {b}", "not in the probe's output"))
            continue
        size = 4 if len(labels) > 200 else 30  # a few clients' prompts: points large enough to see
        for c in range(n_classes):
            sel = labels == c
            ax.scatter(emb[sel, 0], emb[sel, 1], s=size, color=colors[c], alpha=0.8, linewidths=0)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes.ravel()[len(blocks):]:
        ax.set_visible(False)
    names = meta.get("label_names") or [str(c) for c in range(n_classes)]
    kind = meta.get("label_kind", "coarse")
    handles = [Patch(color=colors[c], label=names[c] if c < len(names) else str(c)) for c in range(n_classes)]
    fig.legend(handles=handles, loc="outside right center", fontsize="x-small",
               title=f"{kind} class", ncols=1 if n_classes <= 20 else 2)
    drawn = meta.get("per_class_drawn") or []
    short = [(names[c] if c < len(names) else str(c), f"{n} of {meta.get('per_class')} samples")
             for c, n in enumerate(drawn) if meta.get("per_class") and n < meta["per_class"]]
    add_notes(fig, missing_note("Not drawn", missing) + missing_note("Fewer samples than configured", short))
    counted = " ".join(t for t in (str(len(labels)), meta.get("split", ""), meta.get("unit", "images")) if t)
    set_caption(fig, f"{fig_cfg.get('caption', '')}\n{meta.get('arch', '')}, {counted}, perplexity "
                     f"{meta.get('perplexity', '')}")
    return fig


# ----------------------------------------------------------------------------------------------
# Fig. 6a: congruence vs. key momentum
# ----------------------------------------------------------------------------------------------

def congruence_summary(values: pd.DataFrame) -> pd.DataFrame:
    """Per setting: mean and std (ddof=1) over run seeds of the congruence in %, seeds used, and status."""
    rows = []
    for value, grp in values.groupby("value", sort=True):
        ok = grp.loc[grp["status"] == OK, "congruence"].astype(float) * 100.0
        status = OK if len(ok) else "; ".join(sorted(set(grp["status"])))
        rows.append({"value": float(value), "method": grp["method"].iloc[0], "mean": ok.mean() if len(ok) else math.nan,
                     "std": ok.std(ddof=1) if len(ok) > 1 else math.nan, "n_seeds": len(ok), "status": status})
    return pd.DataFrame(rows, columns=["value", "method", "mean", "std", "n_seeds", "status"])


def congruence_figure(values: pd.DataFrame, fig_cfg: dict, scale: str) -> Figure:
    """SGPT Fig. 6a: congruence score (%) against the swept setting, with the paper's point at paper scale."""
    fig, axes = new_figure(1, 1, panel=(6.6, 4.0))  # room for the legend at the right
    ax = axes[0, 0]
    summary = congruence_summary(values)
    ok = summary.loc[summary["status"] == OK]
    if len(ok):
        ax.errorbar(ok["value"].to_numpy(dtype=float), ok["mean"].to_numpy(dtype=float),
                    yerr=ok["std"].fillna(0.0).to_numpy(dtype=float), marker="o", capsize=3, color="tab:blue",
                    label="ours")
    else:
        mark_empty(ax, "no runs")
    labels = fig_cfg.get("labels") or {}
    missing = []
    for p in summary.loc[summary["status"] != OK].itertuples():
        ax.plot(p.value, 0.02, transform=ax.get_xaxis_transform(), **MISSING_MARK)
        missing.append((f"{p.value:g} ({labels.get(p.method, p.method)})", p.status))
    # seeds that failed beside seeds that worked are also said, not averaged away
    partial = values.loc[(values["status"] != OK) & values["value"].isin(ok["value"])]
    missing += [(f"{r.value:g} ({labels.get(r.method, r.method)}) seed {r.seed}", r.status) for r in partial.itertuples()]
    if scale == "paper" and fig_cfg.get("paper"):
        pp = fig_cfg["paper"]
        ax.scatter([p["value"] for p in pp], [p["y"] for p in pp], marker="D", s=60, facecolors="none",
                   edgecolors="black", zorder=4, label="paper")
    ref = values.loc[values["status"] == OK]
    subtitle = ""
    if len(values):
        q = values["q_kmeans"].dropna()
        subtitle = (f"K-Means K={int(values['k'].iloc[0])} on train Select queries; Q_kmeans = "
                    f"{q.iloc[0]:.3f} ({values['labels'].iloc[0]} labels)" if len(q) else
                    f"K-Means K={int(values['k'].iloc[0])} on train Select queries")
    ax.set_title(subtitle, fontsize="small")
    ax.set_xlabel(fig_cfg["param_label"])
    ax.set_ylabel("congruence score (%)")
    tick_at_values(ax.xaxis, summary["value"])  # the swept settings are discrete
    ax.grid(True, alpha=0.3)
    if len(ref) or (scale == "paper" and fig_cfg.get("paper")):
        outside_legend(ax)
    add_notes(fig, missing_note("Missing (grey ×)", missing))
    set_caption(fig, fig_cfg.get("caption", ""))
    return fig


# ----------------------------------------------------------------------------------------------
# Fig. 7: per-class sample counts of some clients
# ----------------------------------------------------------------------------------------------

def partition_figure(counts: pd.DataFrame, fig_cfg: dict, seed: int | None = None) -> Figure:
    """SGPT Fig. 7: per panel, `per_panel` clients' per-class counts; colour = class, hatch = client."""
    split = fig_cfg.get("split", "train")
    clients = [int(c) for c in fig_cfg["clients"]]
    per_panel = int(fig_cfg.get("per_panel", 2))
    groups = [clients[i:i + per_panel] for i in range(0, len(clients), per_panel)]
    counts = counts.loc[counts["split"] == split]
    n_classes = int(counts["class"].max()) + 1 if len(counts) else 0
    colors = _class_colors(max(n_classes, 1))
    fig, axes = new_figure(len(groups), 1, panel=(11.0, 2.8))  # room for the legends at the right
    hatches = ["", "///", "..", "xx"]
    width = 0.9 / per_panel
    missing = []
    for ax, group in zip(axes[:, 0], groups):
        handles = []
        for j, client in enumerate(group):
            rows = counts.loc[counts["client"] == client]
            if rows.empty:
                missing.append((f"client {client}", "not in the partition"))
                continue
            offset = (j - (len(group) - 1) / 2) * width
            ax.bar(rows["class"] + offset, rows["count"], width=width, color=[colors[c] for c in rows["class"]],
                   hatch=hatches[j % len(hatches)], edgecolor="black", linewidth=0.4)
            if len(rows) <= 20:  # few bars: name their classes, since colours repeat over 100 classes
                for c, n in zip(rows["class"], rows["count"]):
                    ax.text(c + offset, n, str(c), ha="center", va="bottom", fontsize=6)
            handles.append(Patch(facecolor="white", edgecolor="black", hatch=hatches[j % len(hatches)],
                                 label=f"client {client}: {int(rows['count'].sum())} samples, {len(rows)} classes"))
        if handles:  # right of the panel: inside it would cover bars and their class numbers
            outside_legend(ax, handles=handles)
        else:
            mark_empty(ax, "no such clients")
        ax.set_xlim(-0.6, max(n_classes, 1) - 0.4)
        # classes are integers: each one ticked when few, else integer ticks only
        ax.xaxis.set_major_locator(MultipleLocator(1) if n_classes <= 20 else MaxNLocator(integer=True))
        ax.set_ylabel(f"{split} samples")
        ax.grid(True, axis="y", alpha=0.3)
    axes[-1, 0].set_xlabel("class")
    add_notes(fig, missing_note("Not drawn", missing))
    seed_text = "" if seed is None else f" (partition seed {seed})"
    set_caption(fig, f"{fig_cfg.get('caption', '')}{seed_text}")
    return fig


# ----------------------------------------------------------------------------------------------
# FedHPL Fig. 4: heat maps of several partitions
# ----------------------------------------------------------------------------------------------

def partition_grid_figure(counts: list[pd.DataFrame], fig_cfg: dict, seed: int | None = None,
                          experiments: dict | None = None, scale: str | None = None) -> Figure:
    """One client x class heat map per configured panel (``panels``: title, experiment), ``cols`` a row; each title
    names the dataset the experiment reads at this scale (the mini analogue is not the paper's dataset)."""
    from fedcore.partition.plots import class_heatmap_grid

    panels = fig_cfg["panels"]
    if len(counts) != len(panels):
        raise ValueError(f"figure has {len(panels)} panels but {len(counts)} partition count files were given")
    experiments = experiments or {}
    titles = [p["title"] + (f" [{experiments[p['experiment']]['dataset']}]" if p["experiment"] in experiments else "")
              for p in panels]
    fig = class_heatmap_grid(list(zip(counts, titles)), int(fig_cfg.get("cols", 3)), fig_cfg.get("split", "train"))
    seed_text = "" if seed is None else f" (partition seed {seed})"   # the scale: render_figure's caption
    set_caption(fig, f"{fig_cfg.get('caption', '')}{seed_text}")
    add_notes(fig, repeated_panels(counts, [p["title"] for p in panels], experiments,
                                   [p["experiment"] for p in panels]), color="black")
    return fig


def repeated_panels(counts: list[pd.DataFrame], titles: list[str], experiments: dict, exps: list[str]) -> list[str]:
    """One note per panel whose counts repeat an earlier panel's (at mini two paper datasets can map onto one
    analogue with the same partition)."""
    notes = []
    for i, c in enumerate(counts):
        same = next((j for j in range(i) if counts[j].reset_index(drop=True).equals(c.reset_index(drop=True))), None)
        if same is not None:
            here, there = (experiments.get(exps[k], {}).get("dataset") for k in (i, same))
            why = (f"both read {here} with the same partition" if here == there
                   else f"{here} and {there} have the same labels, so the partition is the same")
            notes.append(f"{titles[i]} repeats {titles[same]} at this scale: {why}.")
    return notes


# ----------------------------------------------------------------------------------------------
# FedOTP Fig. A4: transport plans over the image
# ----------------------------------------------------------------------------------------------

def plan_heat(plan: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """One prompt's plan column (M,) as a (gh, gw) map in [0, 1]: min-max normalised per image and prompt (spec §5
    Fig. A4 [R]); a constant plan maps to zeros."""
    heat = np.asarray(plan, dtype=np.float64).reshape(grid)
    lo, hi = heat.min(), heat.max()
    return (heat - lo) / (hi - lo) if hi > lo else np.zeros_like(heat)


def transport_plans_figure(data: dict[str, Any], fig_cfg: dict) -> Figure:
    """Rows = test images; columns = the image, then Global and Local plan of each run (gamma) overlaid on it
    (jet, alpha 0.5, bicubic upsampling of the patch grid); a run without plans keeps its columns, marked."""
    meta = data["meta"]
    images, plans = data["images"], data["plans"]
    runs, status = meta["runs"], meta["status"]
    grid = tuple(int(g) for g in meta["grid"])
    n = len(images)
    fig, axes = new_figure(n, 1 + 2 * len(runs), panel=(1.7, 1.7))
    for i in range(n):
        h, w = images[i].shape[:2]
        ax = axes[i, 0]
        ax.imshow(images[i])
        ax.set_ylabel(f"client {int(data['clients'][i])}\n{meta['class_names'][i]}", fontsize="small")
        if i == 0:
            ax.set_title("image", fontsize="small")
        for r, label in enumerate(runs):
            for j, which in enumerate(("Global", "Local")):
                ax = axes[i, 1 + 2 * r + j]
                if i == 0:
                    ax.set_title(f"{which}\n{label}", fontsize="small")
                if status[r] != OK:
                    mark_empty(ax, status[r])
                    continue
                ax.imshow(images[i])
                ax.imshow(plan_heat(plans[r, i, :, j], grid), cmap="jet", alpha=0.5, interpolation="bicubic",
                          extent=(-0.5, w - 0.5, h - 0.5, -0.5), vmin=0.0, vmax=1.0)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
    missing = [(label, s) for label, s in zip(runs, status) if s != OK]
    add_notes(fig, missing_note("Not drawn", missing))
    set_caption(fig, f"{fig_cfg.get('caption', '')}\n{meta.get('arch', '')}: {grid[0]}x{grid[1]} patches; each map "
                     "min-max normalised per image and prompt")
    return fig
