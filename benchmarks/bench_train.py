"""Training-step throughput of a method on a backbone: images/s of one client's local update.

    python benchmarks/bench_train.py                                   # vit_mini, CPU, every baseline
    python benchmarks/bench_train.py --clients 5                       # + 5 clients one by one vs together
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

from _device import bench_device  # noqa: E402 (benchmarks/, the script's own folder, is first on sys.path)
from fedcore.backbones.images import to_model_input  # noqa: E402
from fedcore.backbones.prompted import PromptedViT, attention_backend  # noqa: E402
from fedcore.backbones.vit import backbone_info, build_vit  # noqa: E402
from fedcore.engine.data import Batch  # noqa: E402
from fedcore.engine.optim import ClientData, TrainSettings  # noqa: E402
from fedcore.engine.roles import Client, FitResult, module_state  # noqa: E402
from fedcore.engine.together import one_by_one, train_together  # noqa: E402
from fedcore.methods import method_class, method_names  # noqa: E402


def _setup(method: str, arch: str, batch: int, device: torch.device):
    """(method, one batch) for ``method`` on random weights; artifacts are random vectors (a cached lookup)."""
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
    extras = {name: torch.randn(batch, vit.embed_dim, device=device) for name in cls.artifacts(m.params)}
    return m, Batch(x, y, torch.arange(batch, device=device), extras)


def seconds(fn, n: int, device: torch.device) -> float:
    """Wall time of ``fn(n)``, the GPU's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(n)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench(method: str, arch: str, batch: int, steps: int, warmup: int, device: torch.device, amp: bool) -> float:
    """Images/s of one client's real local update (``local_epochs=1`` over ``steps`` batches) of ``method``.

    Each image counts once per pass: SGPT's two BCD blocks are two passes, FedEM's components are not.
    """
    m, b = _setup(method, arch, batch, device)
    settings = TrainSettings(1, batch, {"name": "sgd", "lr": 0.01, "momentum": 0.9})
    phases = 2 if method == "sgpt" else 1

    def update(n: int) -> None:
        data = ClientData(0, batch * n, lambda: iter([b] * n), torch.Generator())
        server = m.strategy.init_state(1)
        up = m.client.setup(0, data)
        if up is not None:
            m.strategy.setup(server, [FitResult(0, batch * n, up, {})])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            m.client.fit(0, m.client.init_state(0), m.strategy.configure(server, 0), data, settings)

    update(warmup)
    return phases * batch * steps / seconds(update, steps, device)


def bench_together(method: str, arch: str, batch: int, steps: int, clients: int, device: torch.device,
                   amp: bool) -> tuple[float, float]:
    """Images/s of ``clients`` clients' local updates trained one by one and together (fedcore/engine/together.py)."""
    m, b = _setup(method, arch, batch, device)
    keys, trainable = m.keys(0), m.trainable_keys(0)
    start = module_state(m.model, keys)
    opt = {"name": "sgd", "lr": 0.01, "momentum": 0.9}
    out = []
    for fn in (one_by_one, train_together):
        def run(n: int) -> None:
            streams = [iter([b] * n) for _ in range(clients)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                fn(m.model, keys, trainable, [start] * clients, streams, m.client.loss, opt)
        run(2)  # warm-up
        out.append(clients * batch * steps / seconds(run, steps, device))
    return out[0], out[1]


def main() -> None:
    """Parse arguments and print one throughput line per method."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="vit_mini")
    ap.add_argument("--methods", nargs="+", default=method_names())
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--amp", action="store_true", help="bf16 autocast (GPU)")
    ap.add_argument("--clients", type=int, default=1, help="also time this many clients trained together")
    a = ap.parse_args()
    device, name = bench_device(a.threads)
    print(f"# {a.arch}, batch {a.batch}, {a.steps} steps, {name}, amp={a.amp}")
    for method in a.methods:
        with attention_backend(device):  # as training runs: the math kernel on CPU (vmap has no flash rule there)
            line = f"{method:10s} {bench(method, a.arch, a.batch, a.steps, a.warmup, device, a.amp):10.1f} images/s"
            if a.clients > 1 and method_class(method).client_role.together is not Client.together and device.type == "cuda" \
                    and a.arch.startswith("vit"):
                line += "   (the engine trains ViT clients one by one on CUDA: fedcore/engine/together.py, Limits)"
            elif a.clients > 1 and method_class(method).client_role.together is not Client.together:
                alone, together = bench_together(method, a.arch, a.batch, a.steps, a.clients, device, a.amp)
                line += f"   {a.clients} clients one by one: {alone:10.1f}, together: {together:10.1f} images/s"
        print(line)


if __name__ == "__main__":
    main()
