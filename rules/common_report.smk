# Input functions, captions and code lists of the report rules (rules/report.smk, rules/claims.smk): Snakemake's
# linter wants functions apart from the rules that use them.
from fedcore.data.facts import FACTS
from fedcore.data.sources import FOLDER_LAYOUT_DATASETS
from fedcore.runtime.jobtime import time_path
from fedcore.papers import paper_title
from fedcore.report.html_pages import output_description, output_title, report_caption, report_category, title_key
from fedcore.report.inventory import configured_runs, method_labels, unbuilt_outputs
from fedcore.report.render import figure_input, personalized_flags, table_input
from fedcore.selection import table_run_list

# The code a table or figure runs (its script's imports: rules/common.smk `code`): an edit of it rebuilds them
# (cheap), never a training run.
TABLE_CODE, FIGURE_CODE = code("make_table.py"), code("make_figure.py")

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


def report_papers():
    """The loaded papers with experiments, in the report's order."""
    have = [p for p in CFG.top["papers"] if any(x["paper"] == p for x in CFG.experiments.values())]
    return sorted(have, key=lambda p: report_category(p))


def all_report_pages():
    """The report's pages besides tables and figures: each paper's run inventory (and listed Markdown pages),
    the deviations and the summary."""
    papers = report_papers()
    return ([f"{RESULTS}/report/{p}_runs.html" for p in papers]
            + [f"{RESULTS}/report/{p}_{page}.html" for p in papers for page in REPORT_MARKDOWN_PAGES]
            + [f"{RESULTS}/report/deviations.html", f"{RESULTS}/report/summary.html"])


def all_report_items():
    """Every item of the HTML report: a page per built table and figure and per paper page (results/report/items)."""
    return ([f"{RESULTS}/report/items/tables/{t}.html" for t in CFG.tables if t in CFG.outputs]
            + [f"{RESULTS}/report/items/figures/{f}.html" for f in CFG.figures if f in CFG.outputs]
            + [f"{RESULTS}/report/items/report/{Path(p).stem}.html" for p in all_report_pages()
               if Path(p).name != "summary.html"])


PAGE_KINDS = {"runs": "Runs", **REPORT_MARKDOWN_PAGES}  # a paper page's name suffix -> its subcategory


def _page_of(name):
    """(paper or None, page kind) of a results/report page name ('sgpt_claims', 'deviations')."""
    if name == "deviations":
        return None, "deviations"
    paper, _, kind = name.partition("_")
    return paper, kind


def _outputs_of(kind, paper):
    """The built tables (kind tables) or figures of a paper, in the order of their titles."""
    entries = CFG.tables if kind == "tables" else CFG.figures
    names = [n for n, x in entries.items() if x["source_paper"] == paper and n in CFG.outputs]
    return sorted(names, key=lambda n: title_key(output_title(entries[n]["caption"], n)))


def item_category(wildcards):
    """A report item's section: its paper (numbered in the report's order), or the deviations."""
    if wildcards.folder == "report":
        return report_category(_page_of(wildcards.name)[0])
    entries = CFG.tables if wildcards.folder == "tables" else CFG.figures
    return report_category(entries[wildcards.name]["source_paper"])


def item_subcategory(wildcards):
    """Tables, Figures, or the paper page's kind (Runs, Claim check, Scorecard); the deviations have none."""
    if wildcards.folder == "report":
        paper, kind = _page_of(wildcards.name)
        return None if paper is None else PAGE_KINDS[kind]
    return wildcards.folder.capitalize()


def item_labels(wildcards):
    """The columns a report listing shows for an item: its number in title order, its title and what it shows."""
    if wildcards.folder == "report":
        paper, kind = _page_of(wildcards.name)
        title = "DEVIATIONS.md" if paper is None else f"{paper_title(paper)}: {PAGE_KINDS[kind]}"
        return {"no.": "1", "title": title, "what": item_what(wildcards)}
    entries = CFG.tables if wildcards.folder == "tables" else CFG.figures
    entry = entries[wildcards.name]
    number = _outputs_of(wildcards.folder, entry["source_paper"]).index(wildcards.name) + 1
    return {"no.": f"{number:02d}", "title": output_title(entry["caption"], wildcards.name),
            "what": output_description(entry["caption"])}


ITEM_WHAT = {"runs": "which configured runs have metrics, which are incomplete, missing or not selected, and which "
                     "table cells have no number (and why)",
             "claims": "the paper's headline claims checked on our tables",
             "scorecard": "per table: cells configured, with a run, and why the others have none",
             "deviations": "every choice where a paper is silent and every departure from a paper or its code, "
                           "with measurements"}


def item_what(wildcards):
    return ITEM_WHAT[_page_of(wildcards.name)[1]]


def item_caption(wildcards):
    """The caption Snakemake's report shows for an item (its info panel): the config's caption, or what the page
    holds, and the scale."""
    if wildcards.folder == "report":
        paper, kind = _page_of(wildcards.name)
        who = "DEVIATIONS.md" if paper is None else f"{paper_title(paper)}: {PAGE_KINDS[kind]}"
        return report_caption(f"{who}: {ITEM_WHAT[kind]}.", SCALE)
    entries = CFG.tables if wildcards.folder == "tables" else CFG.figures
    return report_caption(entries[wildcards.name]["caption"], SCALE)


def paper_table_csvs(wildcards):
    """The CSVs of a paper's tables that this run builds (the inventory lists their cells without a number)."""
    return [f"{RESULTS}/tables/{t}.csv" for t, x in CFG.tables.items()
            if x["source_paper"] == wildcards.paper and t in CFG.outputs]


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
        return {"datasets": report_bundles(table), "code": TABLE_CODE}
    return {kind_input: report_data(wildcards.name, kind_input), "bundles": folder_layout_bundles(table),
            "partitions": [x["partition"] for x in table_eval_sets(wildcards.name).values()], "code": TABLE_CODE}


def figure_inputs(wildcards):
    fig = CFG.figures[wildcards.name]
    kind_input = figure_input(fig)
    if kind_input == "datasets":
        return {"datasets": report_bundles(fig), "code": FIGURE_CODE}
    if kind_input == "partition_files":  # one partition file per panel's experiment, all on one dataset
        exps = [CFG.experiments[p["experiment"]] for p in fig["panels"]]
        return {"partition_files": [partition_file(p["experiment"], CFG.seeds[0]) for p in fig["panels"]],
                "dataset": dataset_file(exps[0]["dataset"]), "code": FIGURE_CODE}
    return {kind_input: report_data(wildcards.name, kind_input), "code": FIGURE_CODE}


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


def summary_paper(paper):
    """What the summary page states about a paper besides its report files: the time records of its selected
    training runs (beside their logs, fedcore/runtime/jobtime.py), the data its selected runs train on (with the paper's
    dataset at another scale) and the tables and figures the outputs leave out."""
    runs = [r for r in CFG.runs() if CFG.experiments[r["experiment"]]["paper"] == paper]
    times = [str(time_path(f"{RESULTS}/logs/train/{SCALE}/{r['experiment']}/{r['method']}/seed{r['seed']}.log"))
             for r in runs]
    try:
        logical = CFG.at_scale("paper").experiments if SCALE != "paper" else {}
    except Exception:  # noqa: BLE001 - the paper scale's names are a courtesy here; the summary says the concrete ones
        logical = {}
    data = {}
    for r in runs:
        x = CFG.experiments[r["experiment"]]
        paper_x = logical.get(r["experiment"], {})
        names = [f"{x['dataset']}" + (f" (for {paper_x['dataset']})" if paper_x.get("dataset") not in (None, x["dataset"])
                                      else ""),
                 f"{x['backbone']}" + (f" (for {paper_x['backbone']})" if paper_x.get("backbone") not in (None, x["backbone"])
                                       else "")]
        data[" on ".join(names)] = None
    entries = {**CFG.tables, **CFG.figures}
    unbuilt = [output_title(entries[n]["caption"], n) for n in unbuilt_outputs(CFG, paper)]
    return {"paper": paper, "times": times, "data": list(data), "unbuilt": unbuilt}
