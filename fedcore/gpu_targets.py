"""The one-pass speed targets (README, "A round's clients in one pass") read from the GPU check's benchmark figures,
so that its summary says which are met: a target whose benchmark did not run or printed no figure says so.

Targets (one H100 or H200, bf16, paper shapes, measured side by side in one process):
* ViT-B/16 prompt tuning (FedVPT, SGPT) in one pass: >= 40 % of the bf16 peak over a round;
* SGPT in one pass: >= 10x the official code's round as it ships;
* FedHPL: a paper round <= 40 s (``bench_fedhpl.py``'s one-by-one round over the one pass's speed-up for FedHPL's
  family: an estimate, said as one);
* FedOTP in one pass: >= 3x one by one, at K = 100 with its paper's clients per round.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

# bench_onepass.py's line per family: name C B GFLOP | images/s (one by one, one pass, vmap) | ratios | shares
_ONEPASS = re.compile(r"^\s*(?P<family>\w+)\s+\d+\s+\d+\s+[\d.]+\s+\|\s+(?P<one>\S+)\s+(?P<pass>\S+)\s+\S+\s+\|"
                      r"\s+(?P<ratio>\S+)\s+\S+\s+\|\s*(?P<shares>.*)$")
_OFFICIAL = re.compile(r"^\s*ours, one pass\s+[\d.]+ images/s\s+(?P<x>[\d.]+)x the official as shipped")
_ROUND = re.compile(r"^estimated round .*: (?P<s>[\d.]+) s$")


@dataclass(frozen=True)
class Target:
    """One target: what it asks, the figure measured (None: not measured) and why it is that figure."""

    name: str
    wants: str
    measured: float | None
    unit: str
    met: bool | None
    source: str


def onepass_rows(lines: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """bench_onepass.py's figures per family: one-pass speed-up over one by one and its share of the bf16 peak."""
    out: dict[str, dict[str, float | None]] = {}
    for line in lines:
        m = _ONEPASS.match(line)
        if m is None or line.lstrip().startswith("#"):
            continue
        ratio = m["ratio"].rstrip("x")
        shares = [s.strip().rstrip("%") for s in m["shares"].split(",") if s.strip()]
        out[m["family"]] = {"speedup": float(ratio) if ratio not in ("-", "") else None,
                            "pass_share": float(shares[-1]) / 100 if len(shares) == 2 else None}
    return out


def _first(lines: Sequence[str], pattern: re.Pattern, group: str) -> float | None:
    for line in lines:
        m = pattern.match(line)
        if m:
            return float(m[group])
    return None


def _target(name: str, wants: str, value: float | None, unit: str, ok, source: str) -> Target:
    return Target(name, wants, value, unit, None if value is None else bool(ok(value)), source)


def evaluate(outputs: Mapping[str, Sequence[str]]) -> list[Target]:
    """Each target against the printed figures of the GPU check's benchmark steps (step name -> output lines)."""
    rows = onepass_rows(outputs.get("bench_onepass", ()))
    out = []
    for family in ("fedvpt", "sgpt"):
        share = rows.get(family, {}).get("pass_share")
        out.append(_target(f"{family}: share of the bf16 peak, one pass", ">= 40 %",
                           None if share is None else 100 * share, "%", lambda v: v >= 40.0,
                           "bench_onepass.py (one pass, FLOP per image x images/s over --peak-tflops)"))
    x = _first(outputs.get("bench_sgpt_official", ()), _OFFICIAL, "x")
    out.append(_target("sgpt: ours in one pass over the official code's round", ">= 10x", x, "x",
                       lambda v: v >= 10.0, "bench_sgpt_official.py (needs --sgpt-official)"))
    round_s = _first(outputs.get("bench_fedhpl_vit", ()), _ROUND, "s")
    speedup = rows.get("fedhpl", {}).get("speedup")
    est = None if round_s is None or not speedup else round_s / speedup
    out.append(_target("fedhpl: a paper round (hetvit), estimated", "<= 40 s", est, "s", lambda v: v <= 40.0,
                       "bench_fedhpl.py's one-by-one round / bench_onepass.py's one-pass speed-up for fedhpl"))
    otp = rows.get("fedotp", {}).get("speedup")
    out.append(_target("fedotp: one pass over one by one", ">= 3x", otp, "x", lambda v: v >= 3.0,
                       "bench_onepass.py (K = 100, the paper's clients per round)"))
    return out


def targets_markdown(targets: Sequence[Target]) -> list[str]:
    """The summary's section: one row per target, met / not met / not measured."""
    lines = ["## Issue 24's targets", "", "| target | wants | measured | verdict | from |", "|---|---|---|---|---|"]
    for t in targets:
        measured = "—" if t.measured is None else f"{t.measured:.1f} {t.unit}".replace(" x", "x")
        verdict = "not measured" if t.met is None else "met" if t.met else "NOT met"
        lines.append(f"| {t.name} | {t.wants} | {measured} | {verdict} | {t.source} |")
    return lines + [""]
