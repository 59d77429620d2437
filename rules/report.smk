# Results: concatenate every run's Parquet once; tables and figures are built from that table, from a
# probe's output (rules/probes.smk) or from a partition's class counts, each declared as an input so an
# edit of it reruns the output. The config's `kind` picks the builder (fedcore/report/render.py).
# `snakemake --report results/report.html` gathers every output wrapped in report(...) below into one HTML
# page: a section (category) per paper with its Tables, Figures and Runs, and the Choices and deviations.


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
        html=report(f"{RESULTS}/tables/{{name}}.html", caption=ITEM_CAPTION, category=table_section,
                    subcategory="Tables"),
    params:
        report_caption=table_caption,
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
        png=report(f"{RESULTS}/figures/{{name}}.png", caption=ITEM_CAPTION, category=figure_section,
                   subcategory="Figures"),
        pdf=f"{RESULTS}/figures/{{name}}.pdf",
    params:
        report_caption=figure_caption,
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
        code=REPORT_CODE,
    output:
        html=report(f"{RESULTS}/report/{{paper}}_runs.html", caption=ITEM_CAPTION, category=paper_section,
                    subcategory="Runs"),
        csv=f"{RESULTS}/report/{{paper}}_runs.csv",
    wildcard_constraints:
        paper="|".join(CFG.top["papers"]),
    params:
        runs=lambda wc: configured_runs(CFG, wc.paper),
        labels=lambda wc: method_labels(CFG, wc.paper),
        unbuilt=lambda wc: unbuilt_outputs(CFG, wc.paper),
        scale=SCALE,
        report_caption=lambda wc: report_caption(
            f"{paper_title(wc.paper)}: which configured runs have metrics, which are incomplete or missing, and "
            "which table cells have no number (and why).", SCALE),
    log:
        f"{RESULTS}/logs/report/{{paper}}_runs.log",
    script:
        "../workflow/scripts/run_inventory.py"


rule deviations_page:
    input:
        md=str(DEVIATIONS_MD),
        code=REPORT_CODE,
    output:
        report(f"{RESULTS}/report/deviations.html", caption=ITEM_CAPTION, category="Choices and deviations"),
    params:
        title="Choices, deviations and measurements",
        toc=True,
        report_caption=report_caption(
            "DEVIATIONS.md: every choice where a paper is silent and every departure from a paper or its code, "
            "with measurements.", SCALE),
    log:
        f"{RESULTS}/logs/report/deviations.log",
    script:
        "../workflow/scripts/markdown_page.py"


rule markdown_page:
    input:
        md=f"{RESULTS}/report/{{paper}}_{{page}}.md",
        code=REPORT_CODE,
    output:
        report(f"{RESULTS}/report/{{paper}}_{{page}}.html", caption=ITEM_CAPTION, category=paper_section,
               subcategory=markdown_page_subcategory),
    wildcard_constraints:
        paper="|".join(CFG.top["papers"]),
        page="|".join(REPORT_MARKDOWN_PAGES) or "(?!)",  # no page listed: the rule matches nothing
    params:
        title=lambda wc: f"{paper_title(wc.paper)}: {REPORT_MARKDOWN_PAGES[wc.page]}",
        toc=False,
        report_caption=lambda wc: report_caption(f"{paper_title(wc.paper)}: {REPORT_MARKDOWN_PAGES[wc.page]}.", SCALE),
    log:
        f"{RESULTS}/logs/report/{{paper}}_{{page}}.log",
    script:
        "../workflow/scripts/markdown_page.py"
