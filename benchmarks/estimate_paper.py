"""Each paper's whole paper-scale DAG on one GPU: training time per paper, estimated by fedcore/estimate.py.

    python benchmarks/estimate_paper.py                   # every paper, `outputs=all`, one seed
    python benchmarks/estimate_paper.py --papers fedotp --runs   # one line per run too
    python benchmarks/estimate_paper.py --outputs headline

Sums fedcore.estimate over the training runs of ``snakemake --config scale=paper outputs=all`` (what the DAG trains),
one seed (multiply by the number of seeds). Prints, per paper, the runs, the estimated GPU-hours split into local
training, forward-only passes (evaluation, uploads) and overhead, the largest experiment, and the `runtime` the jobs
ask a cluster for (RUNTIME_MARGIN x the estimate). Non-training jobs (downloads, CLIP tokens and Select queries
once per dataset, probes, tables) are not counted. Every throughput used is listed with its source at the end.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.config import load_config  # noqa: E402
from fedcore.estimate import RATES, RUNTIME_MARGIN, STARTUP_S, estimate_run, request_minutes  # noqa: E402

PAPERS = ["sgpt", "fedhpl", "fedotp", "fedpft"]


def main() -> None:
    """Print the per-paper totals (and per-run lines with --runs)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--papers", nargs="+", default=PAPERS, choices=PAPERS)
    ap.add_argument("--outputs", default="all", help="all | headline (as --config outputs=...)")
    ap.add_argument("--runs", action="store_true", help="one line per run")
    a = ap.parse_args()
    cfg = load_config({"scale": "paper", "papers": a.papers, "seeds": [0], "outputs": a.outputs},
                      Path(__file__).resolve().parents[1])
    per_paper: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_exp: dict[tuple[str, str], float] = defaultdict(float)
    for r in cfg.runs():
        e, m = r["experiment"], r["method"]
        est = estimate_run(cfg, e, m)
        paper = cfg.experiments[e]["paper"]
        t = per_paper[paper]
        t["runs"] += 1
        t["train"] += est.train_s
        t["eval"] += est.eval_s
        t["overhead"] += est.overhead_s
        t["request"] += request_minutes(est) * 60
        per_exp[paper, e] += est.total_s
        if a.runs:
            print(f"{paper:7s} {e:28s} {m:22s} {est.total_s / 3600:8.2f} h  (train {est.train_s / 3600:7.2f}, "
                  f"forward {est.eval_s / 3600:7.2f}, overhead {est.overhead_s / 3600:5.2f}); "
                  f"runtime {request_minutes(est)} min")
    print(f"# scale=paper outputs={a.outputs}, one seed; estimated GPU-hours on one H100 (fedcore/estimate.py); "
          f"cluster runtime = {RUNTIME_MARGIN:g} x estimate; start-up {STARTUP_S:.0f} s a run")
    print(f"{'paper':8s} {'runs':>5s} {'GPU-h':>8s} {'train':>8s} {'forward':>8s} {'overhead':>8s} "
          f"{'asked':>8s}  largest experiment")
    total = defaultdict(float)
    for paper in a.papers:
        t = per_paper[paper]
        if not t["runs"]:
            continue
        hours = (t["train"] + t["eval"] + t["overhead"]) / 3600
        big = max((e for p, e in per_exp if p == paper), key=lambda e: per_exp[paper, e])
        print(f"{paper:8s} {int(t['runs']):5d} {hours:8.1f} {t['train'] / 3600:8.1f} {t['eval'] / 3600:8.1f} "
              f"{t['overhead'] / 3600:8.1f} {t['request'] / 3600:8.1f}  {big} ({per_exp[paper, big] / 3600:.1f} h)")
        for k in ("runs", "train", "eval", "overhead", "request"):
            total[k] += t[k]
    hours = (total["train"] + total["eval"] + total["overhead"]) / 3600
    print(f"{'all':8s} {int(total['runs']):5d} {hours:8.1f} {total['train'] / 3600:8.1f} {total['eval'] / 3600:8.1f} "
          f"{total['overhead'] / 3600:8.1f} {total['request'] / 3600:8.1f}  ({hours / 24:.1f} days on one GPU)")
    print("# throughputs (images/s of one client's update; forward = x eval ratio):")
    for (cls, batch), rate in sorted(RATES.items()):
        print(f"#   {cls:13s} batch {batch:3d}: {rate.images_per_s:8.0f} ({rate.method}), forward x{rate.eval_ratio:.2f}; "
              f"{rate.source}")


if __name__ == "__main__":
    main()
