# Results: concatenate every run's Parquet once; tables and figures are built only from that table.
from fedcore.methods import METHODS


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
        f"{RESULTS}/metrics.parquet",
    output:
        md=f"{RESULTS}/tables/{{name}}.md",
        tex=f"{RESULTS}/tables/{{name}}.tex",
        csv=f"{RESULTS}/tables/{{name}}.csv",
    params:
        table=lambda wc: CFG.tables[wc.name],
        experiments=CFG.report_view(),
        scale=SCALE,
        implemented=sorted(METHODS),
    log:
        f"{RESULTS}/logs/table/{{name}}.log",
    script:
        "../workflow/scripts/make_table.py"


rule figure:
    input:
        f"{RESULTS}/metrics.parquet",
    output:
        png=f"{RESULTS}/figures/{{name}}.png",
        pdf=f"{RESULTS}/figures/{{name}}.pdf",
    params:
        figure=lambda wc: CFG.figures[wc.name],
        experiments=CFG.report_view(),
        scale=SCALE,
    log:
        f"{RESULTS}/logs/figure/{{name}}.log",
    script:
        "../workflow/scripts/make_figure.py"
