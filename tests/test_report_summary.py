"""The report's summary page: its counts are those of the claim checks, scorecards, run inventories and the
training jobs' benchmark files it reads."""
from __future__ import annotations

import html

import pandas as pd
import pytest

from fedcore.claim_rules import FAILS, HOLDS, MISSING, NOT_RUN, NOT_SET_UP, VERDICTS
from fedcore.report.claims_report import CLAIM_COLUMNS
from fedcore.report.scorecard import SCORE_COLUMNS
from fedcore.report.summary import Context, PaperInputs, build_summary, write_summary


def _paper_files(tmp_path, paper: str, verdicts: list[str], with_timing: bool) -> PaperInputs:
    claims = pd.DataFrame([{c: "" for c in CLAIM_COLUMNS} | {"paper": paper, "id": f"c{i}", "scale": "mini",
                                                            "verdict": v} for i, v in enumerate(verdicts)]
                          + [{c: "" for c in CLAIM_COLUMNS} | {"paper": paper, "id": "c0", "scale": "paper",
                                                               "verdict": MISSING}])
    claims.to_csv(tmp_path / f"{paper}_claims.csv", index=False)
    card = pd.DataFrame([{c: 0 for c in SCORE_COLUMNS} | {"section": "cells", "scale": "mini", "table": "all",
                                                         "cells": 20, "with_run": 9, "not_selected": 5,
                                                         "not_configured": 4, "not_implemented": 0, "missing_run": 2}])
    card.to_csv(tmp_path / f"{paper}_scorecard.csv", index=False)
    runs = pd.DataFrame({"experiment": "e", "method": ["a", "b", "c", "d"], "seed": 0, "scale": "mini",
                         "status": ["present", "present", "missing", "not selected"],
                         "diverged_from": [None, 3, None, None]})
    runs.to_csv(tmp_path / f"{paper}_runs.csv", index=False)
    bench = [tmp_path / f"{paper}_a.time.json", tmp_path / f"{paper}_b.time.json"]
    if with_timing:   # the job's own record (fedcore/runtime/jobtime.py); b has none (trained before times were recorded)
        bench[0].write_text('{"cpu_s": 28.0, "user_s": 26.0, "sys_s": 2.0, "wall_s": 30.5, "max_rss_mib": 800}')
    return PaperInputs(paper, tmp_path / f"{paper}_claims.csv", tmp_path / f"{paper}_scorecard.csv",
                       tmp_path / f"{paper}_runs.csv", [str(b) for b in bench], ["digits (for CIFAR-100) on vit_mini"],
                       ["Table 2"])


def test_summary_counts_are_read_from_the_claims_scorecard_inventory_and_benchmarks(tmp_path):
    sgpt = _paper_files(tmp_path, "sgpt", [HOLDS, HOLDS, FAILS, NOT_RUN], True)
    fedhpl = _paper_files(tmp_path, "fedhpl", [NOT_SET_UP, NOT_SET_UP, MISSING], False)
    frame = build_summary([sgpt, fedhpl], "mini").set_index("paper")
    for inp in (sgpt, fedhpl):
        claims = pd.read_csv(inp.claims_csv)
        counts = claims.loc[claims["scale"] == "mini", "verdict"].value_counts()
        assert {v: frame.loc[inp.paper, v] for v in VERDICTS} == {v: counts.get(v, 0) for v in VERDICTS}
        assert frame.loc[inp.paper, "claims"] == len(counts.index.repeat(counts))
    row = frame.loc["sgpt"]
    assert (row["cells"], row["cells_configured"], row["cells_with_run"], row["cells_not_selected"]) == (20, 16, 9, 5)
    assert (row["runs_selected"], row["runs_present"], row["runs_missing"], row["runs_diverged"]) == (3, 2, 1, 1)
    assert (row["runs_timed"], row["wall_s"], row["cpu_s"]) == (1, pytest.approx(30.5), pytest.approx(28.0))
    assert frame.loc["fedhpl", "runs_timed"] == 0


def test_summary_pages_link_each_count_and_say_what_is_left_out(tmp_path):
    inputs = [_paper_files(tmp_path, "sgpt", [HOLDS, NOT_RUN], True)]
    out = {k: tmp_path / f"summary.{k}" for k in ("md", "csv", "html")}
    write_summary(inputs, Context("mini", [0], "headline"), "results", out["md"], out["csv"], out["html"],
                  tmp_path / "landing.html")
    md = out["md"].read_text()
    assert "| [SGPT](sgpt_claims.html) | 2 | [1](sgpt_claims.html) | 0 | [1](sgpt_claims.html) | 0 | 0 |" in md
    assert "[9 of 16](sgpt_scorecard.html)" in md and "[2 of 3](sgpt_runs.html) | [1](sgpt_runs.html) |" in md
    assert "Table 2" in md and "--config outputs=claims" in md and "digits (for CIFAR-100)" in md
    assert "1 timed training jobs of 3 selected used 0.01 h (28 s) of CPU" in md
    landing = html.unescape((tmp_path / "landing.html").read_text())
    assert "results['results/report/items/report/sgpt_claims.html'].data_uri" in landing and "<script" not in landing
    assert pd.read_csv(out["csv"]).loc[0, HOLDS] == 1


def test_a_job_records_its_own_cpu_and_wall_time_at_exit(tmp_path):
    import json
    import subprocess
    import sys

    from fedcore.runtime.jobtime import read_job_time, time_path

    log = tmp_path / "logs" / "seed0.log"
    log.parent.mkdir()
    code = ("from fedcore.runtime.jobtime import record_at_exit; record_at_exit(%r); sum(i * i for i in range(3_000_000))"
            % str(log))
    subprocess.run([sys.executable, "-c", code], check=True)
    rec = read_job_time(time_path(log))
    assert time_path(log).name == "seed0.time.json" and rec["cpu_s"] > 0.05 and rec["wall_s"] > 0
    assert rec["cpu_s"] == pytest.approx(rec["user_s"] + rec["sys_s"], abs=0.01)
    assert read_job_time(tmp_path / "none.time.json") is None
    (tmp_path / "bad.time.json").write_text("{")
    with pytest.raises(ValueError, match="bad.time.json is not a job time record"):
        read_job_time(tmp_path / "bad.time.json")
    assert json.loads(time_path(log).read_text()) == rec
