# Results: concatenate every run's Parquet once; tables and figures are built from that table, from a
# probe's output (rules/probes.smk) or from a partition's class counts, each declared as an input so an
# edit of it reruns the output. The config's `kind` picks the builder (fedcore/report/render.py).
# `snakemake --report results/report.html` gathers every output wrapped in report(...) below into one HTML
# page: the summary on its front page, a section (category) per paper with its Tables, Figures, Runs, Claim check
# and Scorecard, and the Choices and deviations. Each item is a page of its own under results/report/items (a
# figure with its caption under it; a copy of a table or page), built by a job whose only params are its caption:
# the report's info panel shows a job's params, and the jobs that build the tables carry whole config sections.
# They are scripts, not `run:` blocks: Snakemake starts a `run:` job as a Snakemake process of its own, which loads the
# whole workflow again (~5 s of CPU a page); a script starts Python with the page's few imports. Local: cheap.
localrules: figure_page, report_copy


rule aggregate_metrics:
    input:
        runs=all_runs_metrics(),
        code=code("aggregate_metrics.py"),
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
        html=f"{RESULTS}/tables/{{name}}.html",
    params:
        table=lambda wc: CFG.tables[wc.name],
        experiments=CFG.report_view(),
        scale=SCALE,
        implemented=CFG.implemented_methods(),
        eval_sets=lambda wc: table_eval_sets(wc.name),
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


rule run_inventory:
    input:
        metrics=f"{RESULTS}/metrics.parquet",
        tables=paper_table_csvs,
        code=code("run_inventory.py"),
    output:
        html=f"{RESULTS}/report/{{paper}}_runs.html",
        csv=f"{RESULTS}/report/{{paper}}_runs.csv",
    wildcard_constraints:
        paper="|".join(CFG.top["papers"]),
    params:
        runs=lambda wc: configured_runs(CFG, wc.paper),
        labels=lambda wc: method_labels(CFG, wc.paper),
        unbuilt=lambda wc: unbuilt_outputs(CFG, wc.paper),
        scale=SCALE,
    log:
        f"{RESULTS}/logs/report/{{paper}}_runs.log",
    script:
        "../workflow/scripts/run_inventory.py"


rule deviations_page:
    input:
        md=str(DEVIATIONS_MD),
        code=code("markdown_page.py"),
    output:
        f"{RESULTS}/report/deviations.html",
    params:
        title="Choices, deviations and measurements",
        toc=True,
    log:
        f"{RESULTS}/logs/report/deviations.log",
    script:
        "../workflow/scripts/markdown_page.py"


rule markdown_page:
    input:
        md=f"{RESULTS}/report/{{paper}}_{{page}}.md",
        code=code("markdown_page.py"),
    output:
        f"{RESULTS}/report/{{paper}}_{{page}}.html",
    wildcard_constraints:
        paper="|".join(CFG.top["papers"]),
        page="|".join(REPORT_MARKDOWN_PAGES) or "(?!)",  # no page listed: the rule matches nothing
    params:
        title=lambda wc: f"{paper_title(wc.paper)}: {REPORT_MARKDOWN_PAGES[wc.page]}",
        toc=False,
    log:
        f"{RESULTS}/logs/report/{{paper}}_{{page}}.log",
    script:
        "../workflow/scripts/markdown_page.py"


rule figure_page:
    input:
        png=f"{RESULTS}/figures/{{name}}.png",
        code=code("figure_page.py"),
    output:
        report(f"{RESULTS}/report/items/{{folder}}/{{name}}.html", caption=ITEM_CAPTION, category=item_category,
               subcategory=item_subcategory, labels=item_labels),
    wildcard_constraints:
        folder="figures",
    params:
        title=lambda wc: output_title(CFG.figures[wc.name]["caption"], wc.name),
        caption=lambda wc: CFG.figures[wc.name]["caption"],
        scale=SCALE,
        report_caption=item_caption,
    log:
        f"{RESULTS}/logs/report/figure_page/{{folder}}_{{name}}.log",
    script:
        "../workflow/scripts/figure_page.py"


rule report_copy:
    input:
        page=f"{RESULTS}/{{folder}}/{{name}}.html",
        code=code("report_copy.py"),
    output:
        report(f"{RESULTS}/report/items/{{folder}}/{{name}}.html", caption=ITEM_CAPTION, category=item_category,
               subcategory=item_subcategory, labels=item_labels),
    wildcard_constraints:
        folder="tables|report",
    params:
        report_caption=item_caption,
    log:
        f"{RESULTS}/logs/report/items/{{folder}}_{{name}}.log",
    script:
        "../workflow/scripts/report_copy.py"


rule summary:
    input:
        claims=[f"{RESULTS}/report/{p}_claims.csv" for p in report_papers()],
        scorecards=[f"{RESULTS}/report/{p}_scorecard.csv" for p in report_papers()],
        inventories=[f"{RESULTS}/report/{p}_runs.csv" for p in report_papers()],
        code=code("make_summary.py"),
    output:
        md=f"{RESULTS}/report/summary.md",
        csv=f"{RESULTS}/report/summary.csv",
        html=f"{RESULTS}/report/summary.html",
        landing=f"{RESULTS}/report/summary_landing.html",
    params:
        papers=[summary_paper(p) for p in report_papers()],
        scale=SCALE,
        seeds=CFG.seeds,
        outputs=CFG.top["outputs"] if isinstance(CFG.top["outputs"], str) else ", ".join(CFG.top["outputs"]),
        # the results directory (its items' paths in the report), read off the output: <results>/report/summary.md
        results=lambda wc, output: str(Path(output.md).parent.parent),
    log:
        f"{RESULTS}/logs/report/summary.log",
    script:
        "../workflow/scripts/make_summary.py"
