"""FedPFT at mini: accuracy and CPU seconds of FedPFT, FedPFT w/o L_Con and FedAvg at a few budgets (issue 11).

    python benchmarks/study_fedpft_budget.py                                   # the default grid, pft_c10_dir0p1
    python benchmarks/study_fedpft_budget.py --experiment pft_c100_dir0p1 --budgets r10 r30
    python benchmarks/study_fedpft_budget.py --budgets r30:n60:b30:q256 --methods fedpft

A budget is ``r<rounds>[:n<train images a client>][:b<batch>][:q<MoCo queue>][:t<test images a client>][:m<MoCo
momentum>]``; what it
leaves out keeps the experiment's mini value (config/scales/mini/fedpft.yaml). Every run goes through
``fedcore.train.train_run`` with the run's mini params (no Snakemake), on one thread, and prints: the best round's
mean client accuracy (``local_acc``) and that round, the last round's, the curve at every 5th round, the last
round's L_CE / L_Con of the feature phase (FedPFT), and CPU seconds (user + sys of this process, the first run of
the process includes torch's ~5 s of first-step imports; ``--warmup`` spends them before timing).

Measured (2-core shared CPU, one thread, pft_c10_dir0p1 seed 0; best-round accuracy %, CPU s a run; 2026-11-23):

    budget               FedPFT         w/o L_Con     FedAvg
    r10 (old: b30 q64)   31.25 (11.0)   40.00 (3.3)   75.00 (2.7)
    r40                  50.00 (41.4)   85.00 (12.2)  92.50 (10.4)
    r40:q256             68.75 (40.5)
    r40:m0.99 / m0.875   62.50 (45.4) / 67.50 (46.7)
    r20:b10              78.75 (49.4)   91.25 (16.2)  88.75 (14.8)
    r40:b10              88.75 (101.2)  93.75 (31.5)  96.25 (32.3)
    r40:b10:q4096        88.75 (103.3)  (chosen: config/scales/mini/fedpft.yaml)
    r40:b10:q4096:m0.98  88.75 (102.3)

A step costs about the same at batch 10 as at 30 (per-step overhead of these tiny nets): cost follows the steps.
"""
from __future__ import annotations

import argparse
import copy
import resource
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcore.config import load_config  # noqa: E402
from fedcore.data.arrays import load_bundle  # noqa: E402
from fedcore.data.registry import build_dataset  # noqa: E402
from fedcore.partition.make import make_partition  # noqa: E402
from fedcore.train import train_run  # noqa: E402

DEFAULT_BUDGETS = ["r10:b30:q64", "r40:b30:q64", "r20:b10", "r40:b10", "r40:b10:q4096"]


def parse_budget(text: str) -> dict[str, int]:
    """``r40:n60:b30:q256:m0.99`` -> {rounds: 40, images: 60, batch: 30, queue: 256, momentum: 0.99}."""
    keys = {"r": "rounds", "n": "images", "b": "batch", "q": "queue", "t": "test", "m": "momentum"}
    out = {}
    for part in text.split(":"):
        ok = part[:1] in keys and (part[1:].isdigit() or (part[0] == "m" and part[1:].replace(".", "", 1).isdigit()))
        if not ok:
            raise ValueError(f"budget {text!r}: part {part!r} is not one of r<int> n<int> b<int> q<int> t<int> "
                             "m<float>")
        out[keys[part[0]]] = float(part[1:]) if part[0] == "m" else int(part[1:])
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_params(cfg, experiment: str, method: str, budget: dict[str, int]) -> dict:
    """The run's mini params with the budget applied (the same for every method of the experiment)."""
    p = copy.deepcopy(cfg.train_params(experiment, method))
    if "rounds" in budget:
        p["federation"]["rounds"] = budget["rounds"] * (2 if method == "pft_two_stage" else 1)
        if method == "pft_two_stage":
            p["method_params"]["two_stage"] = budget["rounds"]
    if "batch" in budget:
        p["federation"]["batch_size"] = budget["batch"]
    if "queue" in budget and p["method"] == "fedpft":
        p["method_params"]["queue_size"] = budget["queue"]
    if "momentum" in budget and p["method"] == "fedpft":
        p["method_params"]["moco_momentum"] = budget["momentum"]
    part = p["partition"]
    if "images" in budget:
        if "train_per_client" in part:
            part["train_per_client"] = budget["images"]
        else:  # pathological: per class
            part["train_per_class"] = budget["images"] // part.get("classes_per_client", 2)
    if "test" in budget:
        if "test_per_client" in part:
            part["test_per_client"] = budget["test"]
        else:
            part["test_per_class"] = max(1, budget["test"] // part.get("classes_per_client", 2))
    return p


def summarise(metrics: pd.DataFrame) -> dict[str, float]:
    """Best-round and last-round mean client accuracy, the curve, and the last round's losses."""
    agg = metrics[metrics["client"] == -1]
    acc = agg[(agg["split"] == "local") & (agg["metric"] == "acc_mean")].set_index("round")["value"]
    out = {"best": 100 * acc.max(), "best_round": int(acc.idxmax()), "last": 100 * acc.iloc[-1],
           "curve": " ".join(f"{100 * acc.get(r, float('nan')):.0f}" for r in acc.index if r % 5 == 0)}
    last = agg[(agg["round"] == agg["round"].max()) & (agg["split"] == "train")]
    for name in ("ce_feature", "con_feature", "ce_task", "loss"):
        v = last[last["metric"] == name]["value"]
        out[name] = float(v.iloc[0]) if len(v) else float("nan")
    first = agg[(agg["round"] == 1) & (agg["split"] == "train") & (agg["metric"] == "con_feature")]["value"]
    out["con_first"] = float(first.iloc[0]) if len(first) else float("nan")
    return out


def main() -> None:
    """Run the grid and print one line per run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default="pft_c10_dir0p1")
    ap.add_argument("--methods", nargs="+", default=["fedpft", "pft_wo_con", "fedavg"])
    ap.add_argument("--budgets", nargs="+", default=DEFAULT_BUDGETS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", action="store_true", help="one untimed 1-round FedAvg run first (torch imports)")
    ap.add_argument("--work", default=None, help="cache folder for the dataset bundle (default: a temp folder)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config({"scale": "mini", "seeds": [args.seed], "papers": ["fedpft"]}, ROOT)
    exp = cfg.experiments[args.experiment]
    work = Path(args.work or tempfile.mkdtemp(prefix="pftbudget_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"{exp['dataset']}.npz"
    if not data.exists():
        build_dataset(exp["dataset"], data)
    bundle = load_bundle(data)
    budgets = [(b, parse_budget(b)) for b in args.budgets]
    if args.warmup:
        budgets.insert(0, ("warmup", {"rounds": 1}))
    print(f"experiment {args.experiment} ({exp['dataset']}, {exp['backbone']}), seed {args.seed}", flush=True)
    print(f"{'budget':>16} {'method':>11} {'best':>6} {'@':>3} {'last':>6} {'ce_f':>5} {'con_f':>5} {'con1':>5} "
          f"{'cpu_s':>6}  acc every 5th round", flush=True)
    for label, budget in budgets:
        for method in (["fedavg"] if label == "warmup" else args.methods):
            p = run_params(cfg, args.experiment, method, budget)
            part = make_partition(p["partition"], args.seed, bundle.train.y, bundle.test.y, bundle.train.domain,
                                  bundle.test.domain, bundle.train.coarse, bundle.test.coarse)
            run = work / f"{label}_{method}"
            run.mkdir(exist_ok=True)
            part.save(run / "partition.npz")
            identity = {"paper": "fedpft", "experiment": args.experiment, "method": method, "scale": "mini",
                        "dataset": exp["dataset"], "seed": args.seed}
            start = cpu_seconds()
            result = train_run(p, identity, data, run / "partition.npz", exp["backbone"], None,
                               run / "metrics.parquet", run / "final.pt", device="cpu", threads=1, progress=False)
            cpu = cpu_seconds() - start
            s = summarise(result.metrics)
            print(f"{label:>16} {method:>11} {s['best']:6.2f} {s['best_round']:3d} {s['last']:6.2f} "
                  f"{s['ce_feature']:5.2f} {s['con_feature']:5.2f} {s['con_first']:5.2f} {cpu:6.1f}  {s['curve']}",
                  flush=True)


if __name__ == "__main__":
    main()
