"""A paper's report config (config/reports/<paper>.yaml at a scale: tables, figures, claims, headline) checked
against the experiments, and the outputs and runs the config's ``outputs`` picks (fedcore/selection.py decides which
run a cell reads; fedcore/claim_rules.py what a claim reads). No report code is imported."""
from __future__ import annotations

from pathlib import Path

from fedcore.claim_rules import check_claim, claim_runs
from fedcore.config.files import TOP_WHERE, ConfigError, check_name, deep_merge, paper_file, read_yaml, validate
from fedcore.config.resolved import Resolved
from fedcore.selection import (chosen_outputs, claims_outputs, figure_experiments, figure_methods, headline_item,
                               output_runs, replace_experiment, row_source)


def select_outputs(resolved: Resolved) -> None:
    """Pick the outputs the config's ``outputs`` names and the configured runs they read (fedcore/selection.py)."""
    outputs = resolved.top["outputs"]
    headline = {p: r["headline"] for p, r in resolved.reports.items()}
    if outputs == "headline":  # a paper without a list would silently build nothing
        bare = [p for p in resolved.top["papers"] if not headline.get(p)]
        if bare:
            raise ConfigError(f"config error in {TOP_WHERE} at outputs: 'headline' builds each paper's headline: "
                              f"list, but config/reports/<paper>.yaml of {bare} has none (add one, or use "
                              "outputs=all or a list of names)")
    if outputs == "claims":  # every loaded paper's claims: exactly the runs their verdicts need
        _select_claim_runs(resolved)
        return
    try:
        chosen = chosen_outputs(outputs, headline, resolved.tables, resolved.figures)
    except ValueError as e:
        raise ConfigError(f"config error in {TOP_WHERE} at outputs: {e}") from e
    resolved.outputs = list(chosen)
    if outputs == "all":
        resolved.selected = None
        return
    resolved.selected = set().union(*[output_runs(n, resolved.tables, resolved.figures, resolved.experiments, part)
                                      for n, parts in chosen.items() for part in parts])


def _select_claim_runs(resolved: Resolved) -> None:
    """``outputs: claims``: the tables and figures the loaded papers' claims read, and only the runs whose cells
    the claims' verdicts need (fedcore/claim_rules.py claim_runs)."""
    claims = {p: r.get("claims", []) for p, r in resolved.reports.items() if p in resolved.top["papers"]}
    resolved.outputs = list(claims_outputs(claims))
    resolved.selected = set().union(*[claim_runs(c, resolved.tables, resolved.figures, resolved.experiments)
                                      for items in claims.values() for c in items])


def load_report(root: Path, paper: str, scale: dict, scale_file: Path, schema: dict, resolved: Resolved) -> None:
    """Read config/reports/<paper>.yaml, apply the scale's report overrides, validate, fill display labels."""
    report_file = paper_file(root, "reports", paper)
    if not report_file.exists():
        return
    report = read_yaml(report_file)
    validate(report, schema, "report_file", str(report_file))
    runnable = _runnable(resolved)
    labels = {**{v: x["label"] for v, x in resolved.variants.items() if "label" in x}, **report.get("labels", {})}
    for kind, definition in (("tables", "table"), ("figures", "figure")):
        for name, entry in report.get(kind, {}).items():
            if name in getattr(resolved, kind):  # output files are named by the name alone
                first = paper_file(root, "reports", getattr(resolved, kind)[name]["source_paper"])
                raise ConfigError(f"config error in {report_file} at {kind}.{name}: the name is already a "
                                  f"{kind[:-1]} of {first}; table and figure names must be unique across papers")
            where = f"{report_file} ({kind[:-1]} {name})"
            override = scale.get(kind, {}).get(name)
            if override is not None:
                entry = deep_merge(entry, override)
                where = f"{where} after {scale_file}"
            validate(entry, schema, definition, where)
            if entry.get("kind") in ("dataset_stats", "image_grid"):  # data-only: the scale's dataset of each item
                items = entry["rows"] if entry["kind"] == "dataset_stats" else entry["panels"]
                entry["concrete"] = {x["dataset"]: scale["datasets"].get(x["dataset"]) for x in items}
            _check_global_reads(entry, resolved.experiments, where)
            if kind == "tables":
                _check_table(entry, resolved.experiments, where, runnable)
                if entry.get("kind", "metrics") in ("metrics", "linear_probe"):
                    # explicit row_labels win; then the report's labels; then the variants' own labels
                    entry["row_labels"] = {r: entry.get("row_labels", {}).get(r, labels.get(r, r)) for r in entry["rows"]}
            else:
                _check_figure(entry, resolved.experiments, where, runnable)
                entry["labels"] = {m: labels.get(m, m) for m in sorted(figure_methods(entry, resolved.experiments))}
            entry["source_paper"] = paper  # its section of the HTML report (entry["paper"]: the paper's numbers)
            if kind == "tables" and entry.get("kind", "metrics") == "metrics":
                for key in ("reported_round", "identical_rows"):  # the paper's, for the table's notes
                    if key in report:
                        entry[key] = report[key]
            getattr(resolved, kind)[name] = entry
    tables = {n: resolved.tables[n] for n in report.get("tables", {})}
    figures = {n: resolved.figures[n] for n in report.get("figures", {})}
    _check_claims(report.get("claims", []), tables, figures, f"{report_file} (claims) after {scale_file}")
    _check_headline(report.get("headline", []), tables, figures, str(report_file))
    resolved.reports[paper] = {"tables": list(tables), "figures": list(figures), "claims": report.get("claims", []),
                               "headline": list(report.get("headline", []))}


def _check_headline(items: list, tables: dict, figures: dict, where: str) -> None:
    """Headline entries name this paper's tables or figures; a part (rows, columns) only of a table, by its row
    keys and column labels or positions."""
    for i, item in enumerate(items):
        name, part = headline_item(item)
        check_name(name, [*tables, *figures], where, f"headline[{i}]")
        if not part:
            continue
        if name not in tables:
            raise ConfigError(f"config error in {where} at headline[{i}]: rows/columns select part of a table; "
                              f"{name!r} is a figure")
        for row in part.get("rows", []):
            check_name(row, tables[name]["rows"], where, f"headline[{i}].rows")
        labels = [c["label"] for c in tables[name]["columns"]]
        for col in part.get("columns", []):
            if col not in labels and not (isinstance(col, int) and 0 <= col < len(labels)):
                raise ConfigError(f"config error in {where} at headline[{i}].columns: {col!r} is neither a column "
                                  f"label of {name} ({labels}) nor a position 0..{len(labels) - 1}")


def _check_claims(claims: list[dict], tables: dict, figures: dict, where: str) -> None:
    """Claims have unique ids and name tables, rows and columns of this paper that their predicate can read."""
    seen = set()
    for i, claim in enumerate(claims):
        if claim["id"] in seen:
            raise ConfigError(f"config error in {where} at claims[{i}].id: {claim['id']!r} is used twice")
        seen.add(claim["id"])
        try:
            check_claim(claim, tables, figures)
        except ValueError as e:
            raise ConfigError(f"config error in {where} at claims[{i}] ({claim['id']}): {e}") from e


def _runnable(resolved: Resolved) -> set[str]:
    """Names a run's method may take: registered methods and the loaded variants."""
    from fedcore.methods import method_names

    return set(method_names()) | set(resolved.variants)


#: metrics of the global test set, which an experiment with ``evaluation.global_test`` none does not compute
GLOBAL_METRICS = frozenset({"global_acc", "global_acc_min", "global_acc_max"})


def _check_global_reads(node, experiments: dict, where: str, metric: str | None = None, path: str = "") -> None:
    """No table cell or figure point reads a global-test metric of an experiment evaluated without a global test
    set (``global_test: none``): such a cell could only ever say 'missing'."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_global_reads(item, experiments, where, metric, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    if isinstance(node.get("metric"), str):
        metric = node["metric"]
    exp = node.get("experiment")
    if metric in GLOBAL_METRICS and isinstance(exp, str) and exp in experiments \
            and experiments[exp].get("evaluation", {}).get("global_test") == "none":
        raise ConfigError(f"config error in {where} at {path.lstrip('.') or 'top'}: metric {metric} reads the global "
                          f"test set, and experiment {exp!r} has evaluation.global_test none (its runs score the "
                          "clients' own test sets only); read local_acc/worst_local_acc/client_acc, or give it a "
                          "global test")
    for key, value in node.items():
        if key == "row_sources" and isinstance(value, dict):   # each row's experiment, read with every column's metric
            for col in node.get("columns", []):
                for row, src in value.items():
                    _check_global_reads(src, experiments, where, col.get("metric"), f"{path}.row_sources.{row}")
        elif isinstance(value, (dict, list)):
            _check_global_reads(value, experiments, where, metric, f"{path}.{key}")


def _check_figure(fig: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """A figure names known experiments and known methods/variants, and each setting at most once per series."""
    for j, series in enumerate(fig.get("series", [])):
        for k, point in enumerate(series["points"]):
            if "experiment" in point:
                check_name(point["experiment"], experiments, where, f"series[{j}].points[{k}].experiment")
    for j, line in enumerate(fig.get("lines", [])):
        for panel in fig["panels"]:
            check_name(replace_experiment(panel["experiment"], line.get("experiment_replace")), experiments, where,
                        f"lines[{j}].experiment_replace (panel {panel['label']!r})")
    for i, e in enumerate(figure_experiments(fig)):
        check_name(e, experiments, where, f"experiments[{i}]" if "experiments" in fig else "experiment")
    for m in sorted(figure_methods(fig)):
        check_name(m, runnable, where, "methods")
    if fig["kind"] == "partition_bubbles":
        datasets = {experiments[p["experiment"]]["dataset"] for p in fig["panels"]}
        if len(datasets) != 1:
            raise ConfigError(f"config error in {where} at panels: the panels' experiments must share one dataset "
                              f"(the bubbles' domains and classes), got {sorted(datasets)}")
    for j, series in enumerate(fig.get("series", [])):
        values = [p["value"] for p in series["points"]]
        if len(set(values)) != len(values):
            raise ConfigError(f"config error in {where} at series[{j}].points: a setting appears twice in {values}")


def _check_table(table: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """Rows are methods or variants; columns name known experiments; paper rows have one value per column."""
    if table.get("kind") == "param_count":
        _check_param_table(table, experiments, where, runnable)
        return
    if table.get("kind") == "dataset_stats":  # reads bundles only; its rows name datasets, not methods
        return
    if table.get("kind") == "linear_probe":
        _check_probe_table(table, experiments, where, runnable)
        return
    sources = table.get("row_sources", {})
    for row, src in sources.items():
        check_name(row, table["rows"], where, f"row_sources.{row}")
        if "method" in src:
            check_name(src["method"], runnable, where, f"row_sources.{row}.method")
        if "experiment" in src:
            check_name(src["experiment"], experiments, where, f"row_sources.{row}.experiment")
    every_column_names_a_method = all("method" in col for col in table["columns"])
    for i, row in enumerate(table["rows"]):
        if "method" not in sources.get(row, {}) and not every_column_names_a_method:
            check_name(row, runnable, where, f"rows[{i}]")
    for i, col in enumerate(table["columns"]):
        check_name(col["experiment"], experiments, where, f"columns[{i}].experiment")
        if "method" in col:
            check_name(col["method"], runnable, where, f"columns[{i}].method")
        for row in sources:
            check_name(row_source(table, row, col)[1]["experiment"], experiments, where,
                        f"row_sources.{row} (column {i})")
        if col["metric"] == "client_acc" and ("client" in col) == ("clients" in col):
            raise ConfigError(f"config error in {where} at columns[{i}]: metric client_acc needs a 'client' key or "
                              "a 'clients' list, not both")
        if "clients" in col and col["metric"] != "client_acc":
            raise ConfigError(f"config error in {where} at columns[{i}]: 'clients' goes with metric client_acc, "
                              f"not {col['metric']!r}")
        if col["metric"] == "client_acc":
            for exp in dict.fromkeys([col["experiment"], *(row_source(table, r, col)[1]["experiment"]
                                                           for r in sources)]):
                _check_client_indices(col, exp, experiments[exp], f"{where} at columns[{i}]")
    _check_paper_rows(table, where)
    attrs = table.get("row_attributes")
    if attrs:
        for row, values in attrs["values"].items():
            check_name(row, table["rows"], where, f"row_attributes.values.{row}")
            if len(values) != len(attrs["columns"]):
                raise ConfigError(f"config error in {where} at row_attributes.values.{row}: {len(values)} values "
                                  f"for {len(attrs['columns'])} columns")


def _check_client_indices(col: dict, name: str, exp: dict, where: str) -> None:
    """A client_acc column reads clients the experiment has at this scale (else its cell says 'missing metric'
    once every run has trained)."""
    from fedcore.data.facts import dataset_facts
    from fedcore.partition.spec import num_clients

    clients = num_clients(exp["partition"], dataset_facts(exp["dataset"]).domains)
    for c in [col["client"]] if "client" in col else col["clients"]:
        if not 0 <= c < clients:
            raise ConfigError(f"config error in {where}: client {c} of experiment {name!r}, which has {clients} "
                              f"clients (0..{clients - 1})")


def _check_paper_rows(table: dict, where: str) -> None:
    """The paper's numbers (and stds) name table rows and give one value per column."""
    for key in ("paper", "paper_std"):
        for row, values in table.get(key, {}).items():
            check_name(row, table["rows"], where, f"{key}.{row}")
            if len(values) != len(table["columns"]):
                raise ConfigError(f"config error in {where} at {key}.{row}: {len(values)} values for "
                                  f"{len(table['columns'])} columns")


def _check_probe_table(table: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """Rows are methods or read one through ``row_sources``; columns name known experiments; paper rows fit."""
    sources = table.get("row_sources", {})
    for row, src in sources.items():
        check_name(row, table["rows"], where, f"row_sources.{row}")
        check_name(src["method"], runnable, where, f"row_sources.{row}.method")
    for i, row in enumerate(table["rows"]):
        if row not in sources:
            check_name(row, runnable, where, f"rows[{i}]")
    for i, col in enumerate(table["columns"]):
        check_name(col["experiment"], experiments, where, f"columns[{i}].experiment")
    _check_paper_rows(table, where)


def _check_param_table(table: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """A model built from a method names a known experiment and method; others name an architecture."""
    for i, col in enumerate(table["columns"]):
        model = col["model"]
        if model["source"] == "method":
            for key in ("method", "experiment"):
                if key not in model:
                    raise ConfigError(f"config error in {where} at columns[{i}].model: source method needs {key!r}")
            check_name(model["experiment"], experiments, where, f"columns[{i}].model.experiment")
            check_name(model["method"], runnable, where, f"columns[{i}].model.method")
        elif "arch" not in model:
            raise ConfigError(f"config error in {where} at columns[{i}].model: source {model['source']} needs 'arch'")
