# Input functions, captions and code lists of the report rules (rules/report.smk, rules/claims.smk): Snakemake's
# linter wants functions apart from the rules that use them.
from fedcore.report.html_pages import paper_title, report_caption
from fedcore.report.inventory import configured_runs, method_labels, unbuilt_outputs
from fedcore.data.sources import FOLDER_LAYOUT_DATASETS
from fedcore.report.render import figure_input, personalized_flags, table_input

# Report code every table and figure runs: an edit here rebuilds them (cheap), never a training run.
REPORT_CODE = sorted(str(p) for p in (FEDCORE / "report").glob("*.py"))

# >>> Claim checks and scorecards: the ONE place to add them to the HTML report. The rules `claims` and
# `scorecard` (another change) write results/report/{paper}_claims.md and {paper}_scorecard.md; list each page
# name here with its subcategory, e.g. {"claims": "Claim check", "scorecard": "Scorecard"}, and rule
# markdown_page turns it into an HTML page in its paper's section (rule all then asks for it).
REPORT_MARKDOWN_PAGES = {"claims": "Claim check", "scorecard": "Scorecard"}

# Every report item's caption: its config caption and scale, passed as the job's `report_caption` param.
ITEM_CAPTION = "../workflow/report/item.rst"

DEVIATIONS_MD = Path(workflow.basedir) / "DEVIATIONS.md"
if DEVIATIONS_MD.resolve().is_relative_to(Path.cwd().resolve()):
    DEVIATIONS_MD = DEVIATIONS_MD.resolve().relative_to(Path.cwd().resolve())


def all_report_pages():
    """The report's pages besides tables and figures: each paper's run inventory (and listed Markdown pages),
    and the deviations."""
    papers = [p for p in CFG.top["papers"] if any(x["paper"] == p for x in CFG.experiments.values())]
    return ([f"{RESULTS}/report/{p}_runs.html" for p in papers]
            + [f"{RESULTS}/report/{p}_{page}.html" for p in papers for page in REPORT_MARKDOWN_PAGES]
            + [f"{RESULTS}/report/deviations.html"])


def table_section(wildcards):
    """A table's report category: its paper."""
    return paper_title(CFG.tables[wildcards.name]["source_paper"])


def figure_section(wildcards):
    """A figure's report category: its paper."""
    return paper_title(CFG.figures[wildcards.name]["source_paper"])


def paper_section(wildcards):
    """A per-paper page's report category."""
    return paper_title(wildcards.paper)


def table_caption(wildcards):
    return report_caption(CFG.tables[wildcards.name]["caption"], SCALE)


def figure_caption(wildcards):
    return report_caption(CFG.figures[wildcards.name]["caption"], SCALE)


def paper_table_csvs(wildcards):
    """The CSVs of a paper's tables that this run builds (the inventory lists their cells without a number)."""
    return [f"{RESULTS}/tables/{t}.csv" for t, x in CFG.tables.items()
            if x["source_paper"] == wildcards.paper and t in CFG.outputs]


def markdown_page_subcategory(wildcards):
    return REPORT_MARKDOWN_PAGES[wildcards.page]


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


def folder_layout_bundles(table):
    """With allow_folder_layout, the bundles of the table's Office/DomainNet experiments: the table reads their
    meta and marks cells built on image folders (without it such a bundle is refused, so nothing to read)."""
    if not CFG.top["allow_folder_layout"] or table.get("kind", "metrics") != "metrics":
        return []
    datasets = {CFG.experiments[c["experiment"]]["dataset"] for c in table["columns"]}
    return sorted(dataset_file(d) for d in datasets if d in FOLDER_LAYOUT_DATASETS)


def table_inputs(wildcards):
    table = CFG.tables[wildcards.name]
    kind_input = table_input(table)
    if kind_input == "datasets":
        return {"datasets": report_bundles(table), "code": REPORT_CODE}
    return {kind_input: report_data(wildcards.name, kind_input), "bundles": folder_layout_bundles(table),
            "partitions": [x["partition"] for x in table_eval_sets(wildcards.name).values()], "code": REPORT_CODE}


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


def all_claim_reports():
    return [f"{RESULTS}/report/{p}_{what}.{ext}" for p in CFG.top["papers"] for what in ("claims", "scorecard")
            for ext in ("csv", "md")]


def table_eval_sets(name):
    """Per experiment of a metrics table that has a selected run: the first seed's partition file, its global test
    set and the dataset's official test size (None: not known before the data is built); the table's resolution
    columns count each cell's test images from them."""
    from fedcore.data.facts import FACTS
    from fedcore.selection import table_run_list

    table = CFG.tables[name]
    if table.get("kind", "metrics") != "metrics":
        return {}
    out = {}
    for exp, method in table_run_list(table):
        x = CFG.experiments.get(exp)
        if exp in out or x is None or method not in x["methods"] or not CFG.is_selected(exp, method):
            continue
        facts = FACTS.get(x["dataset"])
        out[exp] = {"partition": partition_file(exp, CFG.seeds[0]),
                    "global_test": x["evaluation"].get("global_test", "pooled_local"),
                    "official_size": facts.test.size if facts else None}
    return out
