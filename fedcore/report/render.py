"""One entry point per output kind for the workflow scripts: pick the builder by the config's `kind`.

Each table or figure kind reads one named input (rules/report.smk declares it, so Snakemake reruns the
output when it changes):

    metrics     results/metrics.parquet      tables of kind metrics; figures accuracy_per_round, scatter,
                                             selection_counts, sweep
    counts      probe param_counts CSV        tables of kind param_count (SGPT Table 5)
    embedding   probe tsne .npz               figure tsne (Fig. 5)
    prompt_embedding  probe prompt_tsne .npz  figure prompt_tsne (FedOTP Fig. A5)
    plans       probe transport plans .npz    figure transport_plans (FedOTP Fig. A4)
    values      probe congruence CSV          figure congruence (Fig. 6a)
    partition   a partition's counts CSV      figure partition_counts (Fig. 7)
    partitions  several partitions' counts    figure partition_grid (FedHPL Fig. 4), one CSV per panel
    datasets    dataset bundles               table dataset_stats (FedOTP Table A1), figure image_grid (Fig. A1)
    partition_files  partitions + a bundle    figure partition_bubbles (FedOTP Fig. A2)
    probe_runs  per-run linear-probe CSVs     tables of kind linear_probe (FedPFT Tables 1, 4, 5, 8)
    run_embedding  probe run_tsne .npz        figure run_tsne (FedPFT Figs. 2, 3)
    attention   probe attention .npz          figure attention (FedPFT Fig. 6)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import pandas as pd

if TYPE_CHECKING:  # matplotlib is imported where a figure is built, not by the Snakefile, which reads the tables above
    from matplotlib.figure import Figure

FIGURE_INPUT: dict[str, str] = {
    "accuracy_per_round": "metrics", "scatter": "metrics", "selection_counts": "metrics", "sweep": "metrics",
    "per_class": "metrics", "bars": "metrics",
    "tsne": "embedding", "congruence": "values", "partition_counts": "partition",
    "prompt_tsne": "prompt_embedding", "transport_plans": "plans",
    "partition_grid": "partitions",
    "image_grid": "datasets", "partition_bubbles": "partition_files",
    "run_tsne": "run_embedding", "attention": "attention",
}
TABLE_INPUT: dict[str, str] = {"metrics": "metrics", "param_count": "counts", "dataset_stats": "datasets",
                               "linear_probe": "probe_runs"}


def bundles_by_name(paths) -> dict[str, str]:
    """Dataset bundle files (results/data/<dataset>.npz) by dataset name."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    return {os.path.basename(str(p)).removesuffix(".npz"): str(p) for p in paths}


def figure_input(fig_cfg: dict) -> str:
    """The name of the one data input a figure kind reads."""
    kind = fig_cfg["kind"]
    if kind not in FIGURE_INPUT:
        raise ValueError(f"unknown figure kind {kind!r}; expected one of {sorted(FIGURE_INPUT)}")
    return FIGURE_INPUT[kind]


def table_input(table_cfg: dict) -> str:
    """The name of the one data input a table kind reads."""
    kind = table_cfg.get("kind", "metrics")
    if kind not in TABLE_INPUT:
        raise ValueError(f"unknown table kind {kind!r}; expected one of {sorted(TABLE_INPUT)}")
    return TABLE_INPUT[kind]


def build_figure(fig_cfg: dict, path: str | os.PathLike, context: Mapping[str, Any]) -> Figure:
    """The figure of `fig_cfg` from its data file `path`.

    context: scale, experiments (Resolved.report_view()), implemented (methods and variants with code),
    personalized (method -> bool|None, for the scatter), seed (the partition seed, for partition_counts).
    """
    kind = fig_cfg["kind"]
    scale = context["scale"]
    experiments = context.get("experiments") or {}
    implemented = set(context.get("implemented") or [])
    if figure_input(fig_cfg) == "metrics":
        metrics = pd.read_parquet(path)
        if kind == "accuracy_per_round":
            from fedcore.report.figures import make_figure

            return make_figure(metrics, fig_cfg, scale=scale, experiments=experiments, implemented=implemented)
        from fedcore.report import fig_metrics

        if kind == "scatter":
            return fig_metrics.scatter_figure(metrics, fig_cfg, experiments, scale, implemented,
                                              context.get("personalized"))
        if kind == "selection_counts":
            return fig_metrics.selection_figure(metrics, fig_cfg, experiments, scale, implemented)
        if kind == "per_class":
            return fig_metrics.per_class_figure(metrics, fig_cfg, experiments, scale, implemented)
        if kind == "bars":
            return fig_metrics.bars_figure(metrics, fig_cfg, experiments, scale, implemented)
        return fig_metrics.sweep_figure(metrics, fig_cfg, experiments, scale, implemented)
    from fedcore.report import fig_probes

    if kind in ("tsne", "prompt_tsne"):
        from fedcore.analysis.probe_files import read_tsne

        return fig_probes.tsne_figure(read_tsne(path), fig_cfg)
    if kind == "transport_plans":
        from fedcore.analysis.probe_files import read_transport_plans

        return fig_probes.transport_plans_figure(read_transport_plans(path), fig_cfg)
    if kind == "congruence":
        return fig_probes.congruence_figure(pd.read_csv(path), fig_cfg, scale)
    if kind in ("run_tsne", "attention"):
        from fedcore.report import fig_pft_probes

        return fig_pft_probes.build(kind, path, fig_cfg)
    if kind == "partition_grid":
        return fig_probes.partition_grid_figure([pd.read_csv(p) for p in path], fig_cfg, context.get("seed"),
                                                experiments, scale)
    return fig_probes.partition_figure(pd.read_csv(path), fig_cfg, context.get("seed"))


def render_figure(fig_cfg: dict, inputs: Mapping[str, Any], out_png: str | os.PathLike, out_pdf: str | os.PathLike,
                  context: Mapping[str, Any]) -> None:
    """Build the figure from its named input and write PNG and PDF atomically (with the scale's banner, if any)."""
    from fedcore.report.plotting import save_figure

    # every figure's title says the scale it was drawn at and, below paper scale, how to read its numbers (a PNG is
    # often looked at alone)
    if context.get("scale"):
        fig_cfg = {**fig_cfg, "caption": f"{fig_cfg.get('caption', '')} {figure_scale_note(context['scale'])}".strip()}
    kind = fig_cfg["kind"]
    if kind in ("image_grid", "partition_bubbles"):  # data-only figures read bundles (and partitions) directly
        from fedcore.report import data_outputs

        if kind == "image_grid":
            fig = data_outputs.image_grid_figure(fig_cfg, bundles_by_name(inputs["datasets"]))
        else:
            parts = inputs["partition_files"]
            parts = [parts] if isinstance(parts, (str, os.PathLike)) else list(parts)
            fig = data_outputs.partition_bubbles_figure(fig_cfg, inputs["dataset"], parts)
    else:
        fig = build_figure(fig_cfg, inputs[figure_input(fig_cfg)], context)
    stamp_banner(fig, context.get("scale"))  # data-only figures may be given no context
    save_figure(fig, out_png, out_pdf)


#: what a figure's numbers are at each scale below paper (the tables say it in their scale note)
FIGURE_SCALE_NOTES = {"mini": "mini: embedded analogue data and tiny backbones, not the paper's results",
                      "smoke": "smoke: synthetic data, not results"}


def figure_scale_note(scale: str) -> str:
    """The note that ends every figure's caption: "[scale paper]", or below paper scale what the numbers are."""
    note = FIGURE_SCALE_NOTES.get(scale)
    return f"[scale {note}]" if note else f"[scale {scale}]"


def stamp_banner(fig: Figure, scale: str | None) -> None:
    """Write the scale's banner (smoke: "smoke: synthetic data, not results") in large red letters in a band added
    on top of the figure, above its caption; nothing at the other scales."""
    from fedcore.report.tables import scale_banner

    banner = scale_banner(scale)
    if banner is None:
        return
    band = 0.4  # inches added on top for the banner
    height = fig.get_figheight()
    total = height + band
    fig.set_figheight(total)
    fig.text(0.5, 1.0 - 0.05 / total, banner.upper(), ha="center", va="top", fontsize=16, fontweight="bold",
             color="tab:red")
    top = 1.0 - band / total  # the old figure's top edge, in the new figure's fraction
    caption = fig.get_suptitle()
    if caption:  # pinned right under the band (a suptitle placed by hand is left out of the layout's margins)
        text = fig.suptitle(caption, y=top, va="top", fontsize="medium")
        top -= (text.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi + 0.1) / total
    engine = fig.get_layout_engine()
    if engine is not None and "rect" in engine.get():  # constrained layout: the panels (and notes) stay below
        x0, y0, w, _ = engine.get()["rect"]
        y0 *= height / total
        engine.set(rect=(x0, y0, w, top - y0))


def with_banner(table_cfg: dict, scale: str) -> dict:
    """The table's config with the scale's banner (if any) in front of its caption, which every table writer
    prints (Markdown, LaTeX and HTML alike)."""
    from fedcore.report.tables import scale_banner

    banner = scale_banner(scale)
    return table_cfg if banner is None else {**table_cfg, "caption": f"[{banner.upper()}] {table_cfg.get('caption', '')}"}


def render_table(table_cfg: dict, inputs: Mapping[str, Any], out_md: str | os.PathLike, out_tex: str | os.PathLike,
                 out_csv: str | os.PathLike, context: Mapping[str, Any],
                 out_html: str | os.PathLike | None = None) -> None:
    """Build the table from its named input and write Markdown, LaTeX and CSV atomically, and the report's HTML
    page when ``out_html`` is given."""
    path = inputs[table_input(table_cfg)]
    kind = table_cfg.get("kind", "metrics")
    scale = context["scale"]
    table_cfg = with_banner(table_cfg, scale)
    if kind in ("metrics", "linear_probe"):
        from fedcore.report.tables import build_table, write_table

        if kind == "linear_probe":
            from fedcore.report.probe_table import build_probe_table, read_probe_rows

            table = build_probe_table(read_probe_rows(path), table_cfg, context["experiments"], scale,
                                      set(context["implemented"]))
        else:
            from fedcore.report.resolution import eval_sizes

            experiments = mark_folder_layout(context["experiments"], inputs.get("bundles", []))
            sizes = {e: eval_sizes(x["partition"], x["global_test"], x["official_size"])
                     for e, x in (context.get("eval_sets") or {}).items()}
            table = build_table(pd.read_parquet(path), table_cfg, experiments, scale, set(context["implemented"]),
                                sizes)
        write_table(table, table_cfg, scale, out_md, out_tex, out_csv, out_html)
        return
    if kind == "dataset_stats":
        from fedcore.report.data_outputs import build_dataset_stats, write_dataset_stats

        write_dataset_stats(build_dataset_stats(table_cfg, bundles_by_name(path)), table_cfg, scale,
                            out_md, out_tex, out_csv)
    else:
        from fedcore.report.param_table import build_param_table, write_param_table

        write_param_table(build_param_table(pd.read_csv(path), table_cfg), table_cfg, out_md, out_tex, out_csv)
    if out_html is not None:  # these layouts are not ours-beside-paper columns: the page shows the Markdown
        from fedcore.report.html_pages import write_markdown_table_html

        write_markdown_table_html(Path(out_md).read_text(encoding="utf-8"), out_html, table_cfg["caption"])


def mark_folder_layout(experiments: Mapping[str, dict], bundles) -> Mapping[str, dict]:
    """The experiments' report view with ``folder_layout: true`` on those whose dataset bundle (among
    ``bundles``) was built from image folders (the table marks their cells)."""
    from fedcore.data.arrays import bundle_meta

    paths = [bundles] if isinstance(bundles, (str, os.PathLike)) else list(bundles)
    folder = {m.get("name") for m in map(bundle_meta, paths) if m.get("folder_layout")}
    if not folder:
        return experiments
    return {e: {**x, "folder_layout": x["dataset"] in folder} for e, x in experiments.items()}


def personalized_flags(methods: list[str], base_method) -> dict[str, bool | None]:
    """Per method (or variant): whether its base method is personalised (PFL); None when it has no code yet."""
    from fedcore.methods import is_method, method_class

    out: dict[str, bool | None] = {}
    for m in methods:
        base = base_method(m)
        out[m] = bool(method_class(base).evaluator_role.personalized) if is_method(base) else None
    return out
