"""FedOTP's data-only outputs, computed from the dataset bundles and partitions (spec fedotp §5):

    dataset_stats       Table A1: classes, train / test size and domains of every dataset, ours beside the paper's
    image_grid          Fig. A1: raw images, rows = domains, columns = the first classes (alphabetically)
    partition_bubbles   Fig. A2: one bubble per (client, class[, domain]), area ~ train samples, colour = domain

A row or panel whose dataset the scale does not map (``concrete`` None, filled by fedcore.config) says so.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fedcore.io import atomic_path
from fedcore.report.resolution import exact_resolution
from fedcore.report.plotting import add_notes, mark_empty, new_figure, set_caption

STAT_KEYS = ("classes", "train", "test", "domains")


def bundle_stats(path: str | os.PathLike) -> dict[str, int]:
    """Classes, train size, test size and domains of a bundle, read from its label arrays only (npz is lazy)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta_json"]).decode())
        domains = len(meta.get("domains", [])) or 1  # a dataset without domain labels is one domain (Table A1)
        return {"classes": len(meta["classes"]), "train": int(len(z["train_y"])), "test": int(len(z["test_y"])),
                "domains": domains}


def build_dataset_stats(table_cfg: dict, bundles: dict[str, str | os.PathLike]) -> pd.DataFrame:
    """One row per Table A1 row: dataset (logical), concrete, label, task, ours_<key> and paper_<key>, status."""
    rows = []
    for r in table_cfg["rows"]:
        concrete = table_cfg["concrete"].get(r["dataset"])
        out = {"dataset": r["dataset"], "concrete": concrete, "label": r["label"], "task": r.get("task", "")}
        stats = bundle_stats(bundles[concrete]) if concrete in bundles else {}
        for k in STAT_KEYS:
            out[f"ours_{k}"] = stats.get(k)
            out[f"paper_{k}"] = r.get("paper", {}).get(k)
        out["status"] = "ok" if stats else "not configured at this scale"
        rows.append(out)
    return pd.DataFrame(rows)


def _cell(ours, paper) -> str:
    o = "—" if ours is None or pd.isna(ours) else f"{int(ours):,}"
    p = "—" if paper is None or pd.isna(paper) else f"{int(paper):,}"
    return f"{o} ({p})"


def render_dataset_stats_markdown(table: pd.DataFrame, table_cfg: dict, scale: str) -> str:
    """Markdown: each number as 'ours (paper)'; the concrete dataset names the data behind 'ours'."""
    head = ["Dataset", "Task", "Data here", "Classes", "Training size", "Testing size", "Domains"]
    lines = [f"**{table_cfg['caption']}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in table.iterrows():
        cells = [r["label"], r["task"], r["concrete"] if isinstance(r["concrete"], str) else r["status"]]
        cells += [_cell(r[f"ours_{k}"], r[f"paper_{k}"]) for k in STAT_KEYS]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    note = ("paper scale: ours should equal the paper's" if scale == "paper"
            else f"scale {scale}: ours are the mini analogues' sizes, the paper's are a layout reference only")
    return "\n".join(lines + ["", f"Each cell: ours (paper). {note}."]) + "\n"


def render_dataset_stats_latex(table: pd.DataFrame, table_cfg: dict) -> str:
    """LaTeX tabular of the same cells."""
    esc = lambda s: str(s).replace("_", r"\_").replace("&", r"\&").replace("%", r"\%")  # noqa: E731
    out = [r"\begin{table}[t]", r"\centering", rf"\caption{{{esc(table_cfg['caption'])}}}",
           r"\begin{tabular}{lllrrrr}", r"\toprule",
           r"Dataset & Task & Data here & Classes & Training size & Testing size & Domains \\", r"\midrule"]
    for _, r in table.iterrows():
        cells = [esc(r["label"]), esc(r["task"]), esc(r["concrete"] if isinstance(r["concrete"], str) else r["status"])]
        cells += [esc(_cell(r[f"ours_{k}"], r[f"paper_{k}"])) for k in STAT_KEYS]
        out.append(" & ".join(cells) + r" \\")
    return "\n".join(out + [r"\bottomrule", r"\end{tabular}", r"\end{table}"]) + "\n"


def write_dataset_stats(table: pd.DataFrame, table_cfg: dict, scale: str, out_md, out_tex, out_csv) -> None:
    """Markdown, LaTeX and CSV (the frame itself), atomically."""
    for path, text in ((out_md, render_dataset_stats_markdown(table, table_cfg, scale)),
                       (out_tex, render_dataset_stats_latex(table, table_cfg)),
                       (out_csv, exact_resolution(table).to_csv(index=False))):
        with atomic_path(path) as tmp:
            Path(tmp).write_text(text)


def _load_split(path: str | os.PathLike, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict]:
    with np.load(path, allow_pickle=False) as z:
        dom = z[f"{split}_domain"] if f"{split}_domain" in z else None
        return z[f"{split}_x"], z[f"{split}_y"], dom, json.loads(bytes(z["meta_json"]).decode())


def image_grid_figure(fig_cfg: dict, bundles: dict[str, str | os.PathLike]) -> Figure:
    """Fig. A1: one block per panel dataset; rows = its domains, columns = its first `classes` classes
    alphabetically (spec §5 [R]); each cell the first test image of that domain and class."""
    panels = fig_cfg["panels"]
    n_cols = sum(p.get("classes", 5) for p in panels)
    metas = [_load_split(bundles[c], "test")[3] for c in (fig_cfg["concrete"].get(p["dataset"]) for p in panels)
             if c in bundles]
    n_rows = max([len(m.get("domains", [])) or 1 for m in metas] + [1])
    fig = Figure(figsize=(1.3 * n_cols + 1, 1.3 * n_rows + 0.8), layout="constrained")
    subfigs = fig.subfigures(1, len(panels), width_ratios=[p.get("classes", 5) for p in panels])
    notes = []
    for sub, panel in zip(np.atleast_1d(subfigs), panels):
        concrete = fig_cfg["concrete"].get(panel["dataset"])
        sub.suptitle(f"{panel['label']} ({concrete or 'not configured'})", fontsize=10)
        if concrete not in bundles:
            mark_empty(sub.subplots(1, 1), f"dataset {panel['dataset']} not configured at this scale")
            continue
        x, y, dom, meta = _load_split(bundles[concrete], "test")
        names = meta["classes"]
        domains = meta.get("domains", ["all"])
        dom = np.zeros(len(y), np.int64) if dom is None else dom
        shown = sorted(range(len(names)), key=lambda c: names[c])[: panel.get("classes", 5)]
        axes = np.atleast_2d(sub.subplots(len(domains), len(shown), squeeze=False))
        for i, d in enumerate(domains):
            for j, c in enumerate(shown):
                ax = axes[i, j]
                ax.set_xticks([])
                ax.set_yticks([])
                hit = np.flatnonzero((dom == i) & (y == c))
                if len(hit):
                    ax.imshow(x[hit[0]], interpolation="nearest")
                else:
                    notes.append(f"{concrete}: no test image of class {names[c]} in domain {d}")
                if i == 0:
                    ax.set_title(names[c], fontsize=8)
                if j == 0:
                    ax.set_ylabel(d, fontsize=8)
    set_caption(fig, fig_cfg.get("caption", ""))
    add_notes(fig, notes)
    return fig


def bubble_counts(train_y: np.ndarray, train_domain: np.ndarray | None, train_lists: list[np.ndarray]) -> pd.DataFrame:
    """Long form: client, class, domain, count (> 0) of every client's train samples."""
    dom = np.zeros(len(train_y), np.int64) if train_domain is None else train_domain
    rows = []
    for c, idx in enumerate(train_lists):
        pairs, counts = np.unique(np.stack([train_y[idx], dom[idx]]), axis=1, return_counts=True)
        rows += [(c, int(k), int(d), int(n)) for (k, d), n in zip(pairs.T, counts)]
    return pd.DataFrame(rows, columns=["client", "class", "domain", "count"])


def partition_bubbles_figure(fig_cfg: dict, bundle: str | os.PathLike, partitions: list[str | os.PathLike]) -> Figure:
    """Fig. A2: one panel per experiment's partition; x = client, y = class, area ~ train samples, colour =
    domain (a cell holding several domains draws one bubble per domain, side by side); a key of dot sizes, and a
    colour key only when the data have several domains."""
    from matplotlib.ticker import MaxNLocator

    from fedcore.partition.file import Partition

    _, y, dom, meta = _load_split(bundle, "train")
    domains = meta.get("domains") or []
    panels = fig_cfg["panels"]
    fig, axes = new_figure(1, len(panels), panel=(4.2, 3.6))
    colours = [f"C{i}" for i in range(max(len(domains), 1))]
    loaded = [Partition.load(p) for p in partitions]
    counted = [bubble_counts(y, dom, part.train) for part in loaded]
    biggest = max([int(c["count"].max()) for c in counted if len(c)] + [1])
    area = lambda n: 300.0 * np.asarray(n, dtype=float) / biggest  # noqa: E731 - dot area ~ samples, shared by panels
    n_classes = len(meta["classes"])
    for ax, panel, part, counts in zip(axes.ravel(), panels, loaded, counted):
        offset = (counts["domain"] - (len(colours) - 1) / 2) * (0.5 / len(colours))
        several = counts.groupby(["client", "class"])["domain"].transform("nunique") > 1
        xs = counts["client"] + np.where(several, offset, 0.0)
        ax.scatter(xs, counts["class"], s=area(counts["count"]), c=[colours[d % len(colours)] for d in counts["domain"]],
                   alpha=0.75, edgecolors="none")
        ax.set_title(panel["label"], fontsize=10)
        ax.set_xlabel("client")
        ax.set_ylabel("class")
        ax.set_xticks(range(part.num_clients))
        if n_classes <= 20:
            ax.set_yticks(range(n_classes))
        else:  # every class would print 50 or 100 overlapping labels
            ax.yaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
        ax.set_ylim(-1, n_classes)
        ax.tick_params(labelsize=7)
    keys = sorted({max(1, int(round(biggest / d))) for d in (1, 4, 16)}, reverse=True)
    handles = [axes.ravel()[0].scatter([], [], s=float(area(k)), c="grey", alpha=0.6, label=f"{k} samples")
               for k in keys]
    if len(domains) > 1:
        handles += [axes.ravel()[0].scatter([], [], c=colours[i], label=d) for i, d in enumerate(domains)]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, scatterpoints=1,
               labelspacing=1.2, borderpad=0.8)
    set_caption(fig, fig_cfg.get("caption", ""))
    return fig
