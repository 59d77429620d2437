"""Pretrain the self-supervised tiny ViTs of config/backbones.yaml (`pretrain.objective: moco`) as the pipeline does,
time each, and linear-probe their features on digits beside the supervised twins and a random init.

    python benchmarks/bench_moco.py                      # every moco entry, one thread
    python benchmarks/bench_moco.py --only vit_mini_moco --set epochs=6 lr=2e-3   # explore one entry's settings

Probe: bench_pretrain.probe_accuracy (logistic regression on the digits train split's CLS features, accuracy on
its test split), the probe behind the supervised entries' numbers in config/backbones.yaml. The supervised twin
(same arch, `pretrain` without `objective`) is pretrained here too unless --no-supervised.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_pretrain import digits_bundle, probe_accuracy  # noqa: E402
from fedcore.backbones.pretrain import pretrain  # noqa: E402
from fedcore.backbones.registry import build_backbone  # noqa: E402


def _value(text: str) -> object:
    """A --set value as YAML reads it."""
    return yaml.safe_load(text)


def main() -> None:
    """Parse args, pretrain and probe, print one line per backbone."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", help="backbone names (default: every moco entry)")
    ap.add_argument("--set", nargs="*", default=[], help="override pretrain settings, key=value")
    ap.add_argument("--no-supervised", action="store_true", help="skip the supervised twins")
    args = ap.parse_args()
    entries = yaml.safe_load((ROOT / "config" / "backbones.yaml").read_text())
    moco = {k: e for k, e in entries.items() if e.get("pretrain", {}).get("objective") == "moco"}
    names = args.only or list(moco)
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    bundle, source = digits_bundle()
    print(f"data: {source}; probe on {len(bundle.train)} train / {len(bundle.test)} test images; "
          f"threads={args.threads}")
    torch.set_num_threads(args.threads)
    for name in names:
        entry = moco[name]
        twin = next((k for k, e in entries.items() if e["arch"] == entry["arch"] and "pretrain" in e
                     and "objective" not in e["pretrain"]), None)
        runs = [(name, entry, {**entry["pretrain"], **overrides})]
        if twin and not args.no_supervised:
            runs.append((twin, entries[twin], dict(entries[twin]["pretrain"])))
        for label, e, settings in runs:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "backbone.pt"
                t0 = time.perf_counter()
                st = pretrain(bundle, e["arch"], e.get("tag"), seed=0, out_path=out, threads=args.threads,
                              progress=False, **settings)
                secs = time.perf_counter() - t0
                acc = probe_accuracy(build_backbone(e["arch"], out, e.get("tag")), bundle)
            torch.set_num_threads(args.threads)
            print(f"{label}: {settings}: {secs:.1f} s ({st['images_per_s']:.0f} img/s), probe {acc:.3f}", flush=True)
        torch.manual_seed(0)
        print(f"{entry['arch']} random init: probe {probe_accuracy(build_backbone(entry['arch']), bundle):.3f}")


if __name__ == "__main__":
    main()
