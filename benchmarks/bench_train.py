"""Training-step throughput of a method on a backbone: images/s of one client's local update.

    python benchmarks/bench_train.py                                   # vit_mini, CPU, every baseline
    python benchmarks/bench_train.py --clients 5                       # + a round of 5 clients trained together
    python benchmarks/bench_train.py --arch vit_base_patch16_224 --batch 40 --steps 20 --methods fedvpt head_tune
        (random weights; on a GPU add --amp for bf16 autocast)

Prints one line per method: images/s of its real local update (forward+backward+step, every phase),
measured after warm-up steps.
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
from fedcore.engine.data import QueryBatch  # noqa: E402
from fedcore.methods.base import ClientData, TrainSettings  # noqa: E402


def bench(method: str, arch: str, batch: int, steps: int, warmup: int, device: torch.device, amp: bool) -> float:
    """Images/s of one client's real local update (``local_epochs=1`` over ``steps`` batches) of ``method``.

    Each image counts once per pass: SGPT's two BCD blocks are two passes, FedEM's components are not.
    Select queries, when the method reads them, are random vectors (their cost is a cached lookup).
    """
    torch.manual_seed(0)
    vit = build_vit(arch)
    info = backbone_info(vit)
    cls = method_class(method)
    params = {}
    if method == "sgpt" and len(vit.blocks) < 7:  # vit_mini: the mini scale's s=10 block sets
        params = {"groups": 5, "shared_blocks": [0], "group_blocks": [1, 2], "select_block": len(vit.blocks) - 1}
    m = cls(PromptedViT(vit).to(device), 100, params)
    m.model.to(device)
    raw = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, device=device)
    y = torch.randint(0, 100, (batch,), device=device)
    x = to_model_input(raw, info["img_size"], info["mean"], info["std"])
    extractor = m.frozen_features()
    if extractor is not None:  # the engine computes these once per run; a step then only runs the head
        with torch.no_grad():
            x = extractor(x).float()
    elif cls.uses_select_queries:
        x = QueryBatch(x, torch.randn(batch, m.backbone.embed_dim, device=device))
    settings = TrainSettings(1, batch, {"name": "sgd", "lr": 0.01, "momentum": 0.9})
    phases = 2 if method == "sgpt" else 1

    def update(n: int) -> None:
        data = ClientData(0, batch * n, lambda: iter([(x, y)] * n), torch.Generator())
        m.server_state = m.init_server_state()
        m.setup([data], m.server_state)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            m.local_update(data, settings)

    update(warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    update(steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return phases * batch * steps / (time.perf_counter() - t0)


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
