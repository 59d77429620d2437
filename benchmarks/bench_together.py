"""Seconds per round of a small CNN with BatchNorm (FedPFT's shape): clients one by one vs trained together.

    python benchmarks/bench_together.py                                # CPU, 8 clients x 5 steps, ResNet-8 at 32 px
    python benchmarks/bench_together.py --clients 40 --steps 25        # FedPFT's round (on a GPU)

The model is FedPFT's extractor, a torchvision-style ResNet-8 (7x7 stem, BasicBlocks [1,1,1], widths
64/128/256) + a linear head, trained from scratch with SGD (momentum 0.9), BatchNorm in train mode. Every
client has its own copy of all weights and BatchNorm statistics; ``one_by_one`` trains them in turn (what the
engine does for a method that offers no together path), ``train_together`` in one vmapped pass per step
(fedcore/engine/together.py). Prints seconds per round for each and the ratio.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torchvision.models.resnet import BasicBlock, conv1x1

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _device import device_name  # noqa: E402 (benchmarks/, the script's own folder, is first on sys.path)
from fedcore.engine.data import Batch  # noqa: E402
from fedcore.engine.roles import module_state, state_keys  # noqa: E402
from fedcore.engine.together import one_by_one, train_together  # noqa: E402


def resnet8(classes: int) -> nn.Module:
    """FedPFT's ResNet-8 extractor (spec fedpft §1.2) + a linear head."""
    layers, inplanes = [], 64
    for planes, stride in ((64, 1), (128, 2), (256, 2)):
        down = None if stride == 1 and inplanes == planes else nn.Sequential(conv1x1(inplanes, planes, stride),
                                                                             nn.BatchNorm2d(planes))
        layers.append(BasicBlock(inplanes, planes, stride, down))
        inplanes = planes
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, classes))


def main() -> None:
    """Time one round both ways and print seconds per round."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="local steps per client per round (FedPFT: 25)")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = resnet8(100).to(device).train()
    keys = state_keys(model)
    trainable = [k for k in keys if k in dict(model.named_parameters())]
    start = module_state(model, keys)
    x = torch.randn(a.batch, 3, a.size, a.size, device=device)
    y = torch.randint(0, 100, (a.batch,), device=device)
    batch = Batch(x, y, torch.arange(a.batch, device=device), {})
    opt = {"name": "sgd", "lr": 0.1, "momentum": 0.9}

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return F.cross_entropy(m(b.x), b.y)

    def round_seconds(fn) -> float:
        best = float("inf")
        for _ in range(a.repeats + 1):  # the first is a warm-up
            streams = [iter([batch] * a.steps) for _ in range(a.clients)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(model, keys, trainable, [start] * a.clients, streams, loss, opt)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    name = device_name(device, a.threads)
    alone, together = round_seconds(one_by_one), round_seconds(train_together)
    print(f"# ResNet-8 + BatchNorm, {a.clients} clients x {a.steps} steps of {a.batch} at {a.size} px, {name}")
    print(f"one by one {alone:8.3f} s/round   together {together:8.3f} s/round   speed-up {alone / together:5.2f}x")


if __name__ == "__main__":
    main()
