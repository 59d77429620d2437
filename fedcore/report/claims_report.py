"""One paper's claim check as CSV and Markdown: per claim and per scale, the verdict and the numbers behind it.

`views` maps each scale to what its tables are built with at that scale: ``tables`` and ``figures`` (the
paper's, with that scale's overrides), ``experiments`` (Resolved.report_view()) and ``implemented``. The
CSV has one row per (claim, scale), columns CLAIM_COLUMNS; the claim's check on the paper's own numbers does
not depend on the scale's runs but on its table layout, so it is repeated per scale.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from fedcore.claim_rules import describe, evaluate, source_decimals
from fedcore.io import atomic_path
from fedcore.papers import paper_title
from fedcore.report.claims import claim_grid

CLAIM_COLUMNS = ["paper", "id", "source", "sentence", "table", "predicate", "scale", "verdict", "numbers",
                 "detail", "on_paper_numbers", "paper_detail"]


def claims_frame(paper: str, claims: list[dict], views: Mapping[str, Mapping[str, Any]],
                 metrics: pd.DataFrame) -> pd.DataFrame:
    """Every claim's verdict at every scale of `views` (our numbers, and the paper's numbers as a check)."""
    records = []
    for claim in claims:
        for scale, view in views.items():
            frame = claim_grid(claim, view["tables"], view["figures"], metrics, view["experiments"], scale,
                               set(view["implemented"]))
            decimals = source_decimals(claim, view["tables"])
            ours, theirs = evaluate(claim, frame, decimals), evaluate(claim, frame, decimals, use_paper=True)
            records.append({
                "paper": paper, "id": claim["id"], "source": claim["source"], "sentence": claim["sentence"],
                "table": claim.get("table") or f"figure {claim['figure']}", "predicate": describe(claim),
                "scale": scale, "verdict": ours.verdict, "numbers": ours.numbers_text(decimals),
                "detail": ours.detail, "on_paper_numbers": theirs.verdict, "paper_detail": theirs.detail,
            })
    return pd.DataFrame.from_records(records, columns=CLAIM_COLUMNS)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_claims_markdown(frame: pd.DataFrame, paper: str, metrics_scales: set[str]) -> str:
    """A summary table (claim × scale) and, per claim, its sentence, predicate and the numbers behind it."""
    scales = list(dict.fromkeys(frame["scale"]))
    lines = [f"# {paper_title(paper)}: claim check", "",
             "Each claim is a sentence of the paper with a predicate over a results table (or a sweep figure's "
             "points), evaluated on our numbers as shown (rounded) at each scale: holds / does not hold, or, when "
             "a cell it needs has no number: not selected (configured, but the chosen `outputs` leave its run "
             "out: `--config outputs=claims` builds it), not configured (the scale does not run that method "
             "there) or runs missing (configured and selected, but no metrics: a gap). 'On the paper's numbers' applies the same predicate to the paper's values in those cells "
             "(a check that the predicate encodes the sentence). At mini, data and backbone differ from the "
             "paper's: a verdict there says whether the mini analogue shows the same pattern, nothing more.", ""]
    for s in scales:
        if s not in metrics_scales:
            lines.append(f"Scale {s}: results/metrics.parquet holds no run of this scale (it aggregates the runs "
                         f"of the scale the pipeline ran), so no claim can be judged there.  ")
    lines += ["", "| claim | source | " + " | ".join(scales) + " | on the paper's numbers |",
              "|---|---|" + "---|" * len(scales) + "---|"]
    for cid, rows in frame.groupby("id", sort=False):
        first = rows.iloc[0]
        verdicts = [rows.loc[rows["scale"] == s, "verdict"].iloc[0] for s in scales]
        lines.append(f"| {_md(cid)} | {_md(first['source'])} | " + " | ".join(verdicts)
                     + f" | {first['on_paper_numbers']} |")
    counts = frame.groupby("scale", sort=False)["verdict"].value_counts()
    lines += [""] + [f"Scale {s}: " + ", ".join(f"{n} {v}" for v, n in counts[s].items()) + ".  " for s in scales]
    for cid, rows in frame.groupby("id", sort=False):
        first = rows.iloc[0]
        lines += ["", f"## {cid} ({first['source']})", "", f"> {first['sentence']}", "",
                  f"Predicate on {first['table']}: `{first['predicate']}`", ""]
        for r in rows.itertuples():
            lines.append(f"- **{r.scale}: {r.verdict}**" + (f" ({r.detail})" if r.detail else "") + ". "
                         + (f"Numbers: {r.numbers}." if r.numbers else ""))
        paper_note = f" ({first['paper_detail']})" if first["paper_detail"] else ""
        lines.append(f"- On the paper's numbers: {first['on_paper_numbers']}{paper_note}.")
    return "\n".join(lines).rstrip() + "\n"


def write_claims(frame: pd.DataFrame, paper: str, metrics_scales: set[str], out_csv: str | os.PathLike,
                 out_md: str | os.PathLike) -> None:
    """Write the claim check as CSV and Markdown, both rendered before either is written (atomic)."""
    texts = {Path(out_csv): frame.to_csv(index=False, lineterminator="\n"),
             Path(out_md): render_claims_markdown(frame, paper, metrics_scales)}
    with contextlib.ExitStack() as stack:
        tmps = {path: stack.enter_context(atomic_path(path)) for path in texts}
        for path, text in texts.items():
            tmps[path].write_text(text, encoding="utf-8")


def write_paper_claims(paper: str, claims: list[dict], views: Mapping[str, Mapping[str, Any]],
                       metrics_path: str | os.PathLike, out_csv: str | os.PathLike, out_md: str | os.PathLike) -> None:
    """The workflow's entry: read the aggregated metrics, check the paper's claims at every scale, write both."""
    metrics = pd.read_parquet(metrics_path)
    frame = claims_frame(paper, claims, views, metrics)
    write_claims(frame, paper, set(metrics["scale"].unique()), out_csv, out_md)
