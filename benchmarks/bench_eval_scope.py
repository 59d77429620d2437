"""One evaluated round of K personalised CLIP-prompt clients: every client's prompts scoring the pooled test set of
all clients (``global_test: pooled_local``, as FedOTP's and FedPFT's runs did before session 21) against each
client's prompts scoring its own test set only (``global_test: none``, their protocol now), through the engine's
``evaluate_round`` (clients of one model in one pass, up to 8 a pass). Checks that both give the same local
accuracies.

    python benchmarks/bench_eval_scope.py                                   # CoOp, clip_mini, 20 clients x 50, CPU
    python benchmarks/bench_eval_scope.py --method fedotp --arch clip_vit_b16 --clients 20 --classes 100 \\
        --per-client 100                                 # FedOTP CIFAR-100 shapes, 20 of its 100 clients (GPU)

Random weights and random cached image tokens (the time does not depend on them; FedOTP's OT iterations do, see
bench_fedotp.py). Batch 100 (FedOTP's evaluation batch).

Measured on the shared 2-core CPU machine (another process running: +-30 %), one thread, torch 2.14.1, clip_mini:
    coop,   K = 10,  20 clients x 50 images:  pooled 0.13 s,   own 0.06 s (x2.0: the text tower dominates)
    coop,   K = 10,  40 clients x 100 images: pooled 0.49 s,   own 0.14 s (x3.4)
    fedotp, K = 10,  10 clients x 20 images:  pooled 0.38 s,   own 0.07 s (x5.3)
    fedotp, K = 10,  40 clients x 50 images:  pooled 14.3 s,   own 0.49 s (x29)
    fedotp, K = 100, 20 clients x 50 images:  pooled 37.8 s,   own 2.59 s (x14.6)
every line with the same local accuracies both ways.
No GPU was lent to this task: the paper-shape line is not measured.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _device import bench_device  # noqa: E402 (benchmarks/, the script's own folder, is first on sys.path)
from fedcore.backbones.prompted import attention_backend  # noqa: E402
from fedcore.backbones.registry import build_backbone, input_cfg, prompt_adapter  # noqa: E402
from fedcore.engine.data import DeviceSplit, InputPipeline  # noqa: E402
from fedcore.engine.evaluate import EvalSets, evaluate_round  # noqa: E402
from fedcore.methods import method_class  # noqa: E402
from fedcore.methods.clip_prompt import TOKENS  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    """Time one evaluated round both ways and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="coop", choices=["coop", "fedotp"])
    ap.add_argument("--arch", default="clip_mini")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-client", type=int, default=50, help="test images per client")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    device, name = bench_device(a.threads, a.device)
    torch.manual_seed(0)
    clip = prompt_adapter(build_backbone(a.arch, None)).to(device)
    method = method_class(a.method)(clip, a.classes, {}, class_names=[f"class {k}" for k in range(a.classes)])
    model = method.model.to(device).eval()
    cfg = input_cfg(a.arch)
    n = a.clients * a.per_client
    with torch.no_grad():
        one = clip.encode_image_tokens(torch.zeros(1, 3, cfg["img_size"], cfg["img_size"], device=device))
    g = torch.Generator(device="cpu").manual_seed(1)
    split = DeviceSplit(torch.zeros(n, 32, 32, 3, dtype=torch.uint8, device=device),
                        torch.randint(0, a.classes, (n,), generator=g).to(device),
                        extras={TOKENS: torch.randn(n, *one.shape[1:], generator=g).half().to(device)})
    pipeline = InputPipeline(cfg["img_size"], cfg["mean"], cfg["std"])
    own = list(torch.arange(n, device=device).chunk(a.clients))
    server = method.strategy.init_state(a.clients)
    states = []
    for c in range(a.clients):   # each client's prompts apart from the others' (a mixed-up row would show)
        st = method.client.init_state(c)
        st["model"] = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                       for k, v in st["model"].items()}
        states.append(st)

    def load(c: int | None) -> torch.nn.Module:
        method.evaluator.load(model, c, server, None if c is None else states[c], None)
        return model

    print(f"# {a.method} {a.arch}, K={a.classes} classes, {a.clients} clients x {a.per_client} test images, "
          f"batch {a.batch}, {name}")
    rows, seconds = {}, {}
    with attention_backend(device.type):
        for mode in ("pooled_local", "none"):
            sets = EvalSets(split, own, None, mode)
            _sync(device)
            t = time.perf_counter()
            rows[mode] = evaluate_round(method, sets, pipeline, a.batch, load)
            _sync(device)
            seconds[mode] = time.perf_counter() - t
    local = {m: [v for c, s, k, v in r if s == "local" and k == "acc"] for m, r in rows.items()}
    print(f"pooled (every client scores all {n} images): {seconds['pooled_local']:.2f} s")
    print(f"own test sets only:                          {seconds['none']:.2f} s "
          f"(x{seconds['pooled_local'] / seconds['none']:.1f})")
    print(f"same local accuracies: {'yes' if local['pooled_local'] == local['none'] else 'NO'}")


if __name__ == "__main__":
    main()
