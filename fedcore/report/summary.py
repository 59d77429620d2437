"""The report's landing page: per paper, where its claims stand, how many table cells have a run, which data and
scale the numbers come from, what the runs cost, and what the chosen outputs leave out with the one command that
builds it.

Every count is read from the files the other report jobs wrote (the claim checks, scorecards and run inventories,
all at the scale built) and from each training job's own time record (fedcore/runtime/jobtime.py): nothing is
recomputed here, so the summary cannot disagree with the pages it links. Written as Markdown, CSV, a standalone HTML
page (links to the pages beside it) and an HTML fragment that the report's front page includes (links that open
the report's items).
"""
from __future__ import annotations

import contextlib
import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from fedcore.io import atomic_path
from fedcore.claim_rules import FAILS, HOLDS, MISSING, NOT_RUN, NOT_SET_UP, VERDICTS
from fedcore.report.html_pages import page, paper_title, scale_caption

SUMMARY_COLUMNS = ["paper", "scale", "claims", *VERDICTS, "cells", "cells_configured", "cells_with_run",
                   "cells_not_selected", "runs_selected", "runs_present", "runs_missing", "runs_diverged",
                   "runs_timed", "wall_s", "cpu_s"]
VERDICT_HEADS = {HOLDS: "hold", FAILS: "do not hold", NOT_RUN: "not selected", NOT_SET_UP: "not configured",
                 MISSING: "runs missing"}


@dataclass
class PaperInputs:
    """What the summary reads for one paper: its claim check, scorecard and run inventory CSVs, the time records
    of its selected training runs (absent ones are counted as untimed), and facts from the config."""

    paper: str
    claims_csv: str | os.PathLike
    scorecard_csv: str | os.PathLike
    inventory_csv: str | os.PathLike
    times: list[str] = field(default_factory=list)      # the training jobs' time records
    data: list[str] = field(default_factory=list)        # e.g. "digits (for CIFAR-100)"
    unbuilt: list[str] = field(default_factory=list)     # the paper's tables and figures the outputs leave out


def read_timing(paths: list[str]) -> tuple[int, float, float]:
    """(runs with a time record, their summed wall seconds, their summed CPU seconds) from the training jobs' own
    records (fedcore/runtime/jobtime.py); a run trained before jobs recorded their time has none."""
    from fedcore.runtime.jobtime import read_job_time

    n, wall, cpu = 0, 0.0, 0.0
    for p in paths:
        rec = read_job_time(p)
        if rec is None:
            continue
        n, wall, cpu = n + 1, wall + float(rec["wall_s"]), cpu + float(rec["cpu_s"])
    return n, wall, cpu


def paper_row(inp: PaperInputs, scale: str) -> dict:
    """One paper's counts at ``scale`` (SUMMARY_COLUMNS)."""
    claims = pd.read_csv(inp.claims_csv)
    claims = claims.loc[claims["scale"] == scale]
    unknown = set(claims["verdict"]) - set(VERDICTS)
    if unknown:
        raise ValueError(f"{inp.claims_csv}: unknown verdicts {sorted(unknown)}; expected {list(VERDICTS)}")
    verdicts = claims["verdict"].value_counts()
    card = pd.read_csv(inp.scorecard_csv)
    total = card.loc[(card["section"] == "cells") & (card["scale"] == scale) & (card["table"] == "all")]
    cells = total.iloc[0] if len(total) else pd.Series(0, index=card.columns)
    runs = pd.read_csv(inp.inventory_csv)
    selected = runs.loc[runs["status"] != "not selected"]
    timed, wall, cpu = read_timing(inp.times)
    return {"paper": inp.paper, "scale": scale, "claims": len(claims),
            **{v: int(verdicts.get(v, 0)) for v in VERDICTS},
            "cells": int(cells["cells"]),
            "cells_configured": int(cells["cells"] - cells["not_configured"] - cells["not_implemented"]),
            "cells_with_run": int(cells["with_run"]), "cells_not_selected": int(cells["not_selected"]),
            "runs_selected": len(selected), "runs_present": int((selected["status"] == "present").sum()),
            "runs_missing": int(selected["status"].isin(["missing", "incomplete"]).sum()),
            # an inventory written before divergence was recorded has no such column: none known
            "runs_diverged": int(selected["diverged_from"].notna().sum()) if "diverged_from" in selected else 0,
            "runs_timed": timed, "wall_s": wall, "cpu_s": cpu}


def build_summary(inputs: list[PaperInputs], scale: str) -> pd.DataFrame:
    """One row per paper (SUMMARY_COLUMNS), in the order given."""
    return pd.DataFrame([paper_row(i, scale) for i in inputs], columns=SUMMARY_COLUMNS)


@dataclass
class Context:
    """The run's settings the summary states: scale, seeds, outputs, and the commands that build what is left out."""

    scale: str
    seeds: list[int]
    outputs: str
    claims_command: str = "snakemake --cores 2 --config outputs=claims"
    all_command: str = "snakemake --cores 2 --config outputs=all"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h ({seconds:,.0f} s)"


def compute_text(frame: pd.DataFrame, scale: str) -> str:
    """The runs' cost from the training jobs' own records: CPU time (getrusage), and wall time, which is GPU time at
    paper scale (one GPU a job)."""
    timed, selected = int(frame["runs_timed"].sum()), int(frame["runs_selected"].sum())
    if timed == 0:
        return (f"Compute: no training job of this build has a time record yet ({selected} runs selected; "
                "runs trained before the pipeline recorded times keep none until they are retrained).")
    gpu = (f" At paper scale each job holds one GPU: {frame['wall_s'].sum() / 3600:.2f} GPU-hours."
           if scale == "paper" else "")
    return (f"Compute: the {timed} timed training jobs of {selected} selected used {_hours(frame['cpu_s'].sum())} "
            f"of CPU (each job's own getrusage) in {_hours(frame['wall_s'].sum())} of wall time summed over jobs "
            f"(more than the CPU time when jobs wait for a core).{gpu}")


def render_summary_markdown(frame: pd.DataFrame, inputs: list[PaperInputs], ctx: Context) -> str:
    """The summary as Markdown (links: the pages beside it in results/report/)."""
    return _render(frame, inputs, ctx, md=True, link=lambda p, kind: f"{p}_{kind}.html")


def render_summary_html(frame: pd.DataFrame, inputs: list[PaperInputs], ctx: Context,
                        link: Callable[[str, str], str]) -> str:
    """The summary as an HTML fragment; ``link(paper, kind)`` gives the href of a paper's claims / scorecard /
    runs page."""
    return _render(frame, inputs, ctx, md=False, link=link)


def _render(frame: pd.DataFrame, inputs: list[PaperInputs], ctx: Context, md: bool,
            link: Callable[[str, str], str]) -> str:
    esc = (lambda t: str(t).replace("|", "\\|")) if md else (lambda t: html.escape(str(t), quote=False))

    def a(text, href):
        return f"[{text}]({href})" if md else f'<a href="{html.escape(href)}">{esc(text)}</a>'

    def table(head: list[str], rows: list[list[str]]) -> list[str]:
        if md:
            return ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|",
                    *["| " + " | ".join(r) + " |" for r in rows], ""]
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
        return [f"<table><thead><tr>{''.join(f'<th>{esc(h)}</th>' for h in head)}</tr></thead>"
                f"<tbody>{body}</tbody></table>"]

    def para(text: str) -> list[str]:
        return [text, ""] if md else [f"<p>{text}</p>"]

    def heading(text: str) -> list[str]:
        return [f"## {text}", ""] if md else [f"<h2>{esc(text)}</h2>"]

    by_paper = {i.paper: i for i in inputs}
    out = [f"# Summary: scale {ctx.scale}, outputs {ctx.outputs}", ""] if md else \
        [f"<h1>Summary: scale {esc(ctx.scale)}, outputs {esc(ctx.outputs)}</h1>"]
    out += para(esc(f"{scale_caption(ctx.scale)} Seeds: {', '.join(map(str, ctx.seeds))}."))
    out += heading("Claims")
    rows = []
    for row in frame.to_dict("records"):
        claims_href = link(row["paper"], "claims")
        rows.append([a(paper_title(row["paper"]), claims_href), str(row["claims"])]
                    + [a(row[v], claims_href) if row[v] else "0" for v in VERDICTS])
    total = ["all", str(int(frame["claims"].sum()))] + [str(int(frame[v].sum())) for v in VERDICTS]
    out += table(["paper", "claims", *[VERDICT_HEADS[v] for v in VERDICTS]], rows + [total])
    out += para(esc("Each claim is a sentence of the paper checked on our tables as shown. Not selected: its runs are "
                    "configured but the chosen outputs leave them out (the command below builds them). Not "
                    "configured: this scale does not run a cell it needs. Runs missing: a configured, selected run "
                    "has no metrics (a gap to look at). At mini a verdict says whether the analogue shows the "
                    "paper's pattern, nothing more."))
    out += heading("Table cells and runs")
    rows = []
    for r in frame.itertuples(index=False):
        rows.append([esc(paper_title(r.paper)),
                     a(f"{r.cells_with_run} of {r.cells_configured}", link(r.paper, "scorecard")),
                     str(r.cells_not_selected), str(r.cells - r.cells_configured),
                     a(f"{r.runs_present} of {r.runs_selected}", link(r.paper, "runs")),
                     a(str(r.runs_diverged), link(r.paper, "runs")) if r.runs_diverged else "0",
                     esc(_hours(r.cpu_s) if r.runs_timed else "not recorded")
                     + ("" if r.runs_timed in (0, r.runs_selected) else esc(f" ({r.runs_timed} runs timed)"))])
    out += table(["paper", "cells with a run, of configured", "not selected", "not configured at this scale",
                  "runs present, of selected", "runs diverged (numbers marked !)", "CPU time of the training jobs"],
                 rows)
    out += para(esc(compute_text(frame, ctx.scale)))
    out += heading("Where the numbers come from")
    items = [f"{paper_title(i.paper)}: " + (", ".join(i.data) if i.data else "no run selected") for i in inputs]
    out += ([f"* {esc(t)}" for t in items] + [""]) if md else [f"<ul>{''.join(f'<li>{esc(t)}</li>' for t in items)}</ul>"]
    out += heading("What this build leaves out")
    items = []
    for row in frame.to_dict("records"):
        inp = by_paper[row["paper"]]
        parts = []
        if inp.unbuilt:
            parts.append(f"{len(inp.unbuilt)} tables and figures ({', '.join(inp.unbuilt)})")
        if row["cells_not_selected"]:
            parts.append(f"{row['cells_not_selected']} table cells (not selected)")
        if row[NOT_RUN]:
            parts.append(f"{row[NOT_RUN]} claims (not selected)")
        items.append(f"{paper_title(row['paper'])}: " + ("; ".join(parts) if parts else "nothing"))
    out += ([f"* {esc(t)}" for t in items] + [""]) if md else [f"<ul>{''.join(f'<li>{esc(t)}</li>' for t in items)}</ul>"]
    code = (lambda c: f"`{c}`") if md else (lambda c: f"<code>{esc(c)}</code>")
    out += para(f"{code(ctx.claims_command)} builds every run the claims need, so that each claim is judged "
                f"(add {code('--config papers=[...]')} for some papers); {code(ctx.all_command)} builds every table "
                f"and figure. Claims 'not configured' stay so at this scale whatever the outputs.")
    return "\n".join(out).rstrip() + "\n"


LANDING_CSS = """
.fc-summary { font-size: 13px; color: #222; }
.fc-summary h1 { font-size: 18px; margin: 4px 0 6px 0; } .fc-summary h2 { font-size: 15px; margin: 14px 0 4px 0; }
.fc-summary table { border-collapse: collapse; margin: 4px 0 6px 0; }
.fc-summary th, .fc-summary td { border: 1px solid #c8c8c8; padding: 1px 6px; text-align: right; white-space: nowrap; }
.fc-summary th { background: #eef1f5; font-weight: 600; white-space: normal; }
.fc-summary td:first-child { text-align: left; }
.fc-summary a { color: #1a5fb4; text-decoration: underline; }
.fc-summary p, .fc-summary ul { margin: 4px 0; }
.fc-summary th:first-child { text-align: left; }
.fc-summary code::before, .fc-summary code::after { content: none; }
"""


def report_link(results: str) -> Callable[[str, str], str]:
    """Links that open a paper's page inside Snakemake's report (its items are keyed by their path)."""
    def link(paper: str, kind: str) -> str:
        path = f"{results}/report/items/report/{paper}_{kind}.html"   # the report's copy of the page (rule report_copy)
        return (f"javascript:app.setView({{content:'html',contentPath:results['{path}'].data_uri,"
                f"resultPath:'{path}'}})")
    return link


def write_summary(inputs: list[PaperInputs], ctx: Context, results: str, out_md: str | os.PathLike,
                  out_csv: str | os.PathLike, out_html: str | os.PathLike, out_landing: str | os.PathLike) -> None:
    """Build the summary and write Markdown, CSV, the standalone page and the report's front-page fragment, all
    rendered before any is renamed into place."""
    frame = build_summary(inputs, ctx.scale)
    local = render_summary_html(frame, inputs, ctx, lambda p, kind: f"{p}_{kind}.html")
    landing = render_summary_html(frame, inputs, ctx, report_link(results))
    texts = {Path(out_md): render_summary_markdown(frame, inputs, ctx),
             Path(out_csv): frame.to_csv(index=False, float_format="%.6g", lineterminator="\n"),
             Path(out_html): page("Summary", local),
             # the report's front page is a narrow column: widen it for this fragment (styles apply page-wide)
             # and start it at the top: the report centres its content vertically, which cuts a tall page's top
             Path(out_landing): (f"<style>{LANDING_CSS} .prose.max-w-lg {{ max-width: 62rem; }} "
                                 ".h-screen.overflow-auto { align-items: flex-start; }</style>\n"
                                 f'<div class="fc-summary">{landing}</div>\n')}
    with contextlib.ExitStack() as stack:
        tmps = {path: stack.enter_context(atomic_path(path)) for path in texts}
        for path, text in texts.items():
            tmps[path].write_text(text, encoding="utf-8")
