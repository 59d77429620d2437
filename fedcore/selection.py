"""Which runs a table or figure reads, and the runs a choice of outputs needs (the config's ``outputs``).

Which run a table's cell or a figure's line reads (``row_source``, ``replace_experiment``, ``figure_experiments``,
``figure_methods``) is decided here, from the configuration alone: the config checks it, the report builds with it.

The default pipeline builds each paper's headline outputs only (``outputs: headline``, the ``headline:`` list of
``config/reports/<paper>.yaml``), so that all four papers fit the default run's budget; ``outputs: all`` builds
every table and figure, and a list of names builds those. Every experiment keeps its configured methods: a
cell whose run is configured but not needed by the chosen outputs is *not selected* (the claim check and the
scorecard say so), never silently absent.

A run is an (experiment, method) pair; seeds multiply every run alike.
"""
from __future__ import annotations

from typing import Iterable, Mapping

Run = tuple[str, str]

# A table cell's status: ok (it has a number), or why it has none (the report's tables, claims and scorecards)
OK = "ok"
NOT_IMPLEMENTED = "not implemented"   # the method has no code here
NOT_CONFIGURED = "not configured"     # the experiment does not run the method at this scale
MISSING_RUN = "missing run"           # configured and selected, but its run wrote no metrics
MISSING_METRIC = "missing metric"     # the run's metrics lack the cell's metric
NOT_SELECTED = "not selected"         # configured, but the chosen outputs do not read its run

# data-only tables (they read dataset bundles or count parameters of architectures): no training run
_NO_RUN_TABLES = {"param_count", "dataset_stats"}


def table_run_list(table: dict, part: Mapping[str, list] | None = None) -> list[Run]:
    """(experiment, method) of every cell the table reads, configured or not, in table order (rows, then
    columns), each once; ``part`` may restrict it to some ``rows`` (row keys) and ``columns`` (labels or 0-based
    positions)."""
    if table.get("kind", "metrics") in _NO_RUN_TABLES:
        return []
    part = part or {}
    sources = table.get("row_sources") or {}
    rows = [r for r in table["rows"] if "rows" not in part or r in part["rows"]]
    columns = [c for j, c in enumerate(table["columns"])
               if "columns" not in part or j in part["columns"] or c["label"] in part["columns"]]
    out: dict[Run, None] = {}
    for row in rows:
        for col in columns:
            if table.get("kind") == "linear_probe":  # a probe table's row reads its source's method
                out[(col["experiment"], sources.get(row, {}).get("method", row))] = None
                continue
            method, col = row_source(table, row, col)
            out[(col["experiment"], method)] = None
    return list(out)


def table_runs(table: dict, part: Mapping[str, list] | None = None) -> set[Run]:
    """The set of ``table_run_list``."""
    return set(table_run_list(table, part))


def figure_runs(fig: dict, experiments: Mapping[str, dict]) -> set[Run]:
    """(experiment, method) pairs a figure may read, configured or not: exact for sweeps and per-class lines,
    otherwise every method it names in every experiment it names (an accuracy-per-round figure without a
    ``methods`` list draws all its experiments' methods)."""
    kind = fig["kind"]
    if kind == "sweep":  # its points, and the baselines whose best is drawn as a line (SGPT Fig. 6b)
        return ({(p.get("experiment", fig["experiment"]), p["method"]) for s in fig["series"] for p in s["points"]}
                | {(fig["experiment"], m) for m in fig.get("baselines", [])})
    if kind == "per_class":
        out = {(p["experiment"], m) for p in fig["panels"] for m in fig.get("methods", [])}
        out |= {(replace_experiment(p["experiment"], x.get("experiment_replace")), x["method"])
                for p in fig["panels"] for x in fig.get("lines", [])}
        return out
    if kind in ("run_tsne", "attention"):
        return {(p["experiment"], p["method"]) for p in fig["panels"]}
    if kind == "accuracy_per_round" and "methods" not in fig:
        return {(e, m) for e in fig["experiments"] for m in experiments[e]["methods"]}
    methods = figure_methods(fig)
    return {(e, m) for e in figure_experiments(fig) for m in methods}


def output_runs(name: str, tables: Mapping[str, dict], figures: Mapping[str, dict],
                experiments: Mapping[str, dict], part: Mapping[str, list] | None = None) -> set[Run]:
    """The configured runs (method in the experiment's ``methods``) that the table or figure ``name`` reads (only
    the table's ``part``, if given)."""
    wanted = table_runs(tables[name], part) if name in tables else figure_runs(figures[name], experiments)
    return {(e, m) for e, m in wanted if e in experiments and m in experiments[e]["methods"]}


def claims_outputs(claims: Mapping[str, list[dict]]) -> dict[str, list[dict | None]]:
    """Output name -> [None] for every table or figure a loaded paper's claims read (``outputs: claims``)."""
    return {c.get("table") or c["figure"]: [None] for items in claims.values() for c in items}


def headline_item(item: str | dict) -> tuple[str, dict | None]:
    """(output name, the table part it restricts to or None) of one ``headline:`` entry."""
    if isinstance(item, str):
        return item, None
    return item["output"], {k: item[k] for k in ("rows", "columns") if k in item}


def chosen_outputs(outputs: str | list[str], headline: Mapping[str, list], tables: Iterable[str],
                   figures: Iterable[str]) -> dict[str, list[dict | None]]:
    """Output name -> the parts of it whose runs are trained (a part None: all of it), for what ``outputs``
    picks: every output (``all``), the papers' headline lists (``headline``; an output listed twice trains the
    union of its parts), or the names listed; an unknown name is an error naming the known ones."""
    known = list(tables) + list(figures)
    if outputs == "all":
        return {n: [None] for n in known}
    if outputs == "headline":
        out: dict[str, list[dict | None]] = {}
        for items in headline.values():
            for item in items:
                name, part = headline_item(item)
                out.setdefault(name, []).append(part)
        return out
    unknown = [n for n in outputs if n not in known]
    if unknown:
        raise ValueError(f"outputs names {unknown}, which no loaded paper defines; tables and figures: {known}")
    return {n: [None] for n in outputs}


def row_source(table_cfg: dict, row: str, col: dict) -> tuple[str, dict]:
    """(method, column) a row's cell reads. The method: the row's ``row_sources`` method, else the column's
    ``method`` (FedOTP Table A4: columns are the gamma variants, rows experiments), else the row itself. The
    experiment: the row's source ``experiment``, else the column's with the source's ``experiment_replace: [old,
    new]`` applied (FedHPL Table 2's "FedHPL (ViT)" row reads the heterogeneous-ViT experiment of each
    heterogeneous-ResNet column), else the column's."""
    src = (table_cfg.get("row_sources") or {}).get(row) or {}
    method = src.get("method") or col.get("method") or row
    experiment = src.get("experiment") or replace_experiment(col["experiment"], src.get("experiment_replace"))
    return method, {**col, "experiment": experiment}


def replace_experiment(experiment: str, replace: list[str] | None) -> str:
    """``experiment`` with ``replace = [old, new]`` applied (a row or line that reads another experiment); as is
    without one."""
    if not replace or not replace[0]:
        return experiment
    return experiment.replace(replace[0], replace[1])


def figure_experiments(fig: dict) -> list[str]:
    """The experiments a figure reads (one panel each for accuracy_per_round and per_class)."""
    if fig["kind"] == "partition_grid":
        return list(dict.fromkeys(p["experiment"] for p in fig["panels"]))
    if fig["kind"] == "per_class":  # a line may read another experiment per panel (experiment_replace)
        return list(dict.fromkeys([p["experiment"] for p in fig["panels"]]
                                  + [replace_experiment(p["experiment"], x.get("experiment_replace"))
                                     for p in fig["panels"] for x in fig.get("lines", [])]))
    if fig["kind"] == "bars":
        return list(dict.fromkeys(c["experiment"] for c in fig["columns"]))
    if fig["kind"] == "image_grid":  # reads datasets, not runs
        return []
    if fig["kind"] in ("partition_bubbles", "run_tsne", "attention"):
        return list(dict.fromkeys(p["experiment"] for p in fig["panels"]))
    if fig["kind"] == "sweep":  # a point may read its own experiment (a setting of the data, not the method)
        return list(dict.fromkeys([fig["experiment"]] + [p["experiment"] for s in fig["series"]
                                                         for p in s["points"] if "experiment" in p]))
    return list(fig["experiments"]) if "experiments" in fig else [fig["experiment"]]


def figure_methods(fig: dict, experiments: dict[str, dict] | None = None) -> set[str]:
    """Every method or variant a figure names (accuracy_per_round: its experiments' methods)."""
    names = set(fig.get("methods", [])) | set(fig.get("baselines", [])) | {x["method"] for x in fig.get("lines", [])}
    names |= {r["method"] for r in fig.get("runs", [])}
    if "method" in fig:
        names.add(fig["method"])
    if fig["kind"] == "bars":  # rows read through row_sources are labels; their method is what runs
        sources = fig.get("row_sources", {})
        names |= {sources[r]["method"] if r in sources else r for r in fig["rows"]}
    if fig["kind"] == "scatter":
        names |= set(fig.get("paper", {}))
    if "highlight" in fig:
        names.add(fig["highlight"])
    names |= {p["method"] for p in fig.get("points", [])} | {p["method"] for p in fig.get("panels", []) if "method" in p}
    for series in fig.get("series", []):
        names |= {p["method"] for p in series["points"]}
    if fig["kind"] == "accuracy_per_round" and experiments is not None:
        for e in fig["experiments"]:
            names |= set(experiments[e]["methods"])
    return names
