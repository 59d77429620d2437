# Results: concatenate every run's Parquet once; tables and figures are built from that table, from a
# probe's output (rules/probes.smk) or from a partition's class counts, each declared as an input so an
# edit of it reruns the output. The config's `kind` picks the builder (fedcore/report/render.py).
from fedcore.report.render import figure_input, personalized_flags, table_input

# Report code every table and figure runs: an edit here rebuilds them (cheap), never a training run.
REPORT_CODE = sorted(str(p) for p in (FEDCORE / "report").glob("*.py"))


def partition_counts_file(exp, seed):
    """The class-count summary the partition rule writes beside the partition file."""
    return partition_file(exp, seed).removesuffix(".npz") + ".counts.csv"


def report_data(name, kind_input):
    """Path of the one data file a table or figure named `name` reads (see fedcore/report/render.py)."""
    if kind_input == "metrics":
        return f"{RESULTS}/metrics.parquet"
    if kind_input == "counts":
        return f"{RESULTS}/probes/{name}/param_counts.csv"
    if kind_input == "embedding":
        return f"{RESULTS}/probes/{name}/tsne.npz"
    if kind_input == "prompt_embedding":
        return f"{RESULTS}/probes/{name}/prompt_tsne.npz"
    if kind_input == "plans":
        return f"{RESULTS}/probes/{name}/transport_plans.npz"
    if kind_input == "values":
        return f"{RESULTS}/probes/{name}/congruence.csv"
    if kind_input == "probe_runs":  # rules/probes_runs.smk: one CSV per probed run
        return linear_probe_files(name)
    if kind_input == "run_embedding":
        return f"{RESULTS}/probes/{name}/run_tsne.npz"
    if kind_input == "attention":
        return f"{RESULTS}/probes/{name}/attention.npz"
    if kind_input == "partition":
        return partition_counts_file(CFG.figures[name]["experiment"], CFG.seeds[0])
    if kind_input == "partitions":
        return [partition_counts_file(p["experiment"], CFG.seeds[0]) for p in CFG.figures[name]["panels"]]
    raise ValueError(f"unknown report input {kind_input!r}")


def report_bundles(entry):
    """The bundles a data-only table or figure reads: the scale's dataset of each row or panel (if mapped)."""
    return sorted({dataset_file(c) for c in entry["concrete"].values() if c is not None})


def table_inputs(wildcards):
    table = CFG.tables[wildcards.name]
    kind_input = table_input(table)
    if kind_input == "datasets":
        return {"datasets": report_bundles(table), "code": REPORT_CODE}
    return {kind_input: report_data(wildcards.name, kind_input), "code": REPORT_CODE}


def figure_inputs(wildcards):
    fig = CFG.figures[wildcards.name]
    kind_input = figure_input(fig)
    if kind_input == "datasets":
        return {"datasets": report_bundles(fig), "code": REPORT_CODE}
    if kind_input == "partition_files":  # one partition file per panel's experiment, all on one dataset
        exps = [CFG.experiments[p["experiment"]] for p in fig["panels"]]
        return {"partition_files": [partition_file(p["experiment"], CFG.seeds[0]) for p in fig["panels"]],
                "dataset": dataset_file(exps[0]["dataset"]), "code": REPORT_CODE}
    return {kind_input: report_data(wildcards.name, kind_input), "code": REPORT_CODE}


def figure_personalized(wildcards):
    """PFL/GFL per method, for the scatter's markers (only what the figure draws, so params stay stable)."""
    fig = CFG.figures[wildcards.name]
    return personalized_flags(fig.get("methods", []), CFG.base_method) if fig["kind"] == "scatter" else {}


rule aggregate_metrics:
    input:
        all_runs_metrics(),
    output:
        f"{RESULTS}/metrics.parquet",
    log:
        f"{RESULTS}/logs/aggregate_metrics.log",
    script:
        "../workflow/scripts/aggregate_metrics.py"


rule table:
    input:
        unpack(table_inputs),
    output:
        md=f"{RESULTS}/tables/{{name}}.md",
        tex=f"{RESULTS}/tables/{{name}}.tex",
        csv=f"{RESULTS}/tables/{{name}}.csv",
    params:
        table=lambda wc: CFG.tables[wc.name],
        experiments=CFG.report_view(),
        scale=SCALE,
        implemented=CFG.implemented_methods(),
    log:
        f"{RESULTS}/logs/table/{{name}}.log",
    script:
        "../workflow/scripts/make_table.py"


rule figure:
    input:
        unpack(figure_inputs),
    output:
        png=f"{RESULTS}/figures/{{name}}.png",
        pdf=f"{RESULTS}/figures/{{name}}.pdf",
    params:
        figure=lambda wc: CFG.figures[wc.name],
        experiments=CFG.report_view(),
        scale=SCALE,
        implemented=CFG.implemented_methods(),
        personalized=figure_personalized,
        seed=CFG.seeds[0],
    log:
        f"{RESULTS}/logs/figure/{{name}}.log",
    script:
        "../workflow/scripts/make_figure.py"
