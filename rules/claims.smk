# Per paper: its headline claims checked on our tables (holds / does not hold / runs missing, per scale) and
# the reproduction scorecard (cells with a run; at scale paper, cells within 1.5 points of the paper's).
# Both read only the aggregated metrics (claims and the scorecard use tables of kind metrics and sweep figures).


rule claims:
    input:
        metrics=f"{RESULTS}/metrics.parquet",
        code=code("make_claims.py"),
    output:
        csv=f"{RESULTS}/report/{{paper}}_claims.csv",
        md=f"{RESULTS}/report/{{paper}}_claims.md",
    wildcard_constraints:
        paper="|".join(CFG.top["papers"]),
    params:
        claims=lambda wc: CFG.reports.get(wc.paper, {}).get("claims", []),
        views=lambda wc: CFG.claims_view(wc.paper),
    log:
        f"{RESULTS}/logs/claims/{{paper}}.log",
    script:
        "../workflow/scripts/make_claims.py"


rule scorecard:
    input:
        metrics=f"{RESULTS}/metrics.parquet",
        code=code("make_scorecard.py"),
    output:
        csv=f"{RESULTS}/report/{{paper}}_scorecard.csv",
        md=f"{RESULTS}/report/{{paper}}_scorecard.md",
    wildcard_constraints:
        paper="|".join(CFG.top["papers"]),
    params:
        views=lambda wc: CFG.claims_view(wc.paper),
    log:
        f"{RESULTS}/logs/scorecard/{{paper}}.log",
    script:
        "../workflow/scripts/make_scorecard.py"
