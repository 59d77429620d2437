"""Training-step throughput of a method on a backbone: images/s of one client's local update.

    python benchmarks/bench_train.py                                   # vit_mini, CPU, every baseline
    python benchmarks/bench_train.py --clients 5                       # + a round of 5 clients trained together
    python benchmarks/bench_train.py --arch vit_base_patch16_224 --batch 40 --steps 20 --methods fedvpt head_tune
        (random weights; on a GPU add --amp for bf16 autocast)

Prints one line per method: images/s of forward+backward+step, measured after warm-up steps.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.backbones.images import to_model_input  # noqa: E402
from fedcore.backbones.prompted import PromptedViT  # noqa: E402
from fedcore.backbones.vit import backbone_info, build_vit  # noqa: E402
from fedcore.methods import METHODS, method_class  # noqa: E402
from fedcore.engine.batched import train_together  # noqa: E402
from fedcore.methods.base import ClientData, TrainSettings, make_optimizer  # noqa: E402


def bench(method: str, arch: str, batch: int, steps: int, warmup: int, device: torch.device, amp: bool) -> float:
    """Images/s of ``steps`` optimiser steps of ``method`` on random uint8 images."""
    torch.manual_seed(0)
    vit = build_vit(arch)
    info = backbone_info(vit)
    m = method_class(method)(PromptedViT(vit).to(device), 100, {})
    m.model.to(device)
    params = [p for p in m.model.parameters() if p.requires_grad]
    opt = make_optimizer(params, {"name": "sgd", "lr": 0.01, "momentum": 0.9})
    raw = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, device=device)
    y = torch.randint(0, 100, (batch,), device=device)

    extractor = m.frozen_features()
    cached = None
    if extractor is not None:  # the engine computes these once per run; a step then only runs the head
        with torch.no_grad():
            cached = extractor(to_model_input(raw, info["img_size"], info["mean"], info["std"])).float()

    def step() -> None:
        x = cached if cached is not None else to_model_input(raw, info["img_size"], info["mean"], info["std"])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = m.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def bench_together(method: str, arch: str, batch: int, steps: int, clients: int, device: torch.device) -> float:
    """Images/s of ``clients`` clients' local updates trained together (fedcore/engine/batched.py)."""
    torch.manual_seed(0)
    vit = build_vit(arch)
    info = backbone_info(vit)
    m = method_class(method)(PromptedViT(vit).to(device), 100, {})
    m.model.to(device)
    raw = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, device=device)
    y = torch.randint(0, 100, (batch,), device=device)
    x = to_model_input(raw, info["img_size"], info["mean"], info["std"])
    datas = [ClientData(c, batch * steps, lambda: iter([(x, y)] * steps), torch.Generator()) for c in range(clients)]
    start = m.get_state(m.trainable_names())
    settings = TrainSettings(1, batch, {"name": "sgd", "lr": 0.01, "momentum": 0.9})
    train_together(m, [start] * clients, datas, settings)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    train_together(m, [start] * clients, datas, settings)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clients * batch * steps / (time.perf_counter() - t0)


def main() -> None:
    """Parse arguments and print one throughput line per method."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="vit_mini")
    ap.add_argument("--methods", nargs="+", default=sorted(METHODS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--amp", action="store_true", help="bf16 autocast (GPU)")
    ap.add_argument("--clients", type=int, default=1, help="also time this many clients trained together")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {a.threads} thread(s)"
    print(f"# {a.arch}, batch {a.batch}, {a.steps} steps, {name}, amp={a.amp}")
    for method in a.methods:
        line = f"{method:10s} {bench(method, a.arch, a.batch, a.steps, a.warmup, device, a.amp):10.1f} images/s"
        if a.clients > 1 and method_class(method).batched_clients:
            together = bench_together(method, a.arch, a.batch, a.steps, a.clients, device)
            line += f"   {a.clients} clients together: {together:10.1f} images/s"
        print(line)


if __name__ == "__main__":
    main()
