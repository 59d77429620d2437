"""Seconds per round of FedProto / FedTGP at FedHPL's paper scale (heterogeneous ResNet18/34/50/34/18 at 224 px,
entire models, common width 512), on random images: each client's local update and the server step.

    python benchmarks/bench_prototypes.py --steps 50            # on a GPU; CIFAR10 at 5 clients is 625 steps of 16

Prints per method: seconds per local step of each architecture, the server step, and a round extrapolated to
``--round-steps`` steps per client.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.backbones.registry import build_backbone, prompt_adapter  # noqa: E402
from fedcore.engine.data import Batch  # noqa: E402
from fedcore.engine.optim import ClientData, TrainSettings  # noqa: E402
from fedcore.engine.roles import RoundInfo  # noqa: E402
from fedcore.methods import method_class  # noqa: E402

ARCHS = ("resnet18", "resnet34", "resnet50")
ORDER = [0, 1, 2, 1, 0]


def client_data(cid: int, steps: int, bs: int, classes: int, device: str) -> ClientData:
    """``steps`` random batches (fixed per client) as one epoch."""
    g = torch.Generator(device=device).manual_seed(cid)
    xs = [torch.randn(bs, 3, 224, 224, generator=g, device=device) for _ in range(steps)]
    ys = [torch.randint(classes, (bs,), generator=g, device=device) for _ in range(steps)]
    idx = torch.arange(bs, device=device)
    return ClientData(cid, steps * bs, lambda: iter([Batch(x, y, idx, {}) for x, y in zip(xs, ys)]),
                      torch.Generator().manual_seed(cid))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--round-steps", type=int, default=625)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for name in ("fedproto", "fedtgp"):
        torch.manual_seed(0)
        method = method_class(name)([prompt_adapter(build_backbone(a)) for a in ARCHS], args.classes,
                                    {"common_dim": 512}, ORDER).to(args.device)
        server = method.strategy
        state = server.init_state(5)
        settings = TrainSettings(1, args.bs, {"name": "sgd", "lr": 0.01, "momentum": 0.9})
        per_arch: dict[str, float] = {}
        results = []
        for rnd in (1, 2):   # round 1 warms up (and is CE only); round 2 is timed
            results = []
            for cid in range(5):
                data = client_data(cid, args.steps, args.bs, args.classes, args.device)
                method.model_for(cid).train()
                sync(args.device)
                t = time.perf_counter()
                _, res = method.client.fit(cid, method.client.init_state(cid), server.configure(state, cid), data,
                                           settings)
                sync(args.device)
                if rnd == 2:
                    per_arch[ARCHS[ORDER[cid]]] = (time.perf_counter() - t) / args.steps
                results.append(res)
            sync(args.device)
            t = time.perf_counter()
            state = server.aggregate(RoundInfo(rnd, 5, 1.0, 0), state, results)
            sync(args.device)
            server_s = time.perf_counter() - t
        local = sum(per_arch[ARCHS[i]] for i in ORDER) * args.round_steps
        print(f"{name}: s/step " + ", ".join(f"{a} {s:.4f}" for a, s in per_arch.items())
              + f"; server {server_s:.3f} s; round of {args.round_steps} steps/client ≈ {local + server_s:.1f} s "
              f"(clients one by one)")


if __name__ == "__main__":
    main()
