"""FedOTP local steps per second: cached image tokens (ours, artifact clip_tokens) vs re-encoding the images every
step (the official code's way), and the OT solver's share of a step.

    python benchmarks/bench_fedotp.py                                   # mini: clip_mini, 10 classes, CPU
    python benchmarks/bench_fedotp.py --arch clip_vit_b16 --classes 100   # paper: ViT-B/16, CIFAR-100 (GPU, bf16)

Random weights unless ``--weights`` (the encoders' speed does not depend on them; the OT's does: Algorithm 1 stops
on an absolute change of v < 1e-3, and v grows like exp(C/lambda), so near-orthogonal patches and prompts (random
or weak encoders, C ~ 1) run all 100 iterations while CLIP-like similarities (~0.22, M = 196) stop after ~8).
32-px uint8 images resized on the device to the backbone's input, batch 32, n_ctx 16, 2 prompts, unbalanced OT
(gamma 0.8, lambda 0.1, eps 1e-3, at most 100 iterations). A step is the real client update (FedOTP's loss: text
encoder over 2K prompts, similarities, OT, CE, backward, SGD; bf16 autocast on CUDA, as the engine). "re-encode"
adds the frozen image tower's forward of the batch to every step (the official code's way).

Measured on the shared 2-core CPU machine, one thread, torch 2.14.1, the pipeline's pretrained clip_mini
(``--weights results/backbones/clip_mini.pt``), three runs at K = 10 (the digits; the machine is shared: +-20 %):
    cached tokens  10.5-13.5 steps/s (74-95 ms/step)
    re-encode       8.5-9.9 steps/s (101-117 ms/step): caching is x1.2-1.5 faster per step
    OT solver      47-52 ms of each step: the batch's slowest problem runs 98 of the 100 iterations
Re-checked on the final FedOTP code (same machine and weights, 40 steps): cached 14.1 steps/s (71 ms), re-encode
9.6 (104 ms), x1.47; OT 42.5 ms/step, 100 iterations.
K = 100 (CIFAR-100's class count), same CLIP, 10 steps: cached 2.4 steps/s, re-encode 2.1 (x1.16), OT 197 ms/step.
Random weights, K = 10: cached 14.6, re-encode 10.4 steps/s, OT 43 ms/step (87 iterations).
At mini the OT, not the image tower (4 blocks on 17 tokens), dominates a step, so caching gains little there; at
paper scale the ViT-B/16 forward of 32 images is the larger share (spec official_code B6). No GPU was lent to
this task: the paper-scale line (``--arch clip_vit_b16 --classes 100``) is not measured.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _device import bench_device  # noqa: E402 (benchmarks/, the script's own folder, is first on sys.path)
from fedcore.backbones.images import to_model_input  # noqa: E402
from fedcore.backbones.registry import build_backbone, input_cfg, prompt_adapter  # noqa: E402
from fedcore.engine.data import Batch  # noqa: E402
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for, run_epochs  # noqa: E402
from fedcore.methods.clip_prompt import TOKENS  # noqa: E402
from fedcore.methods.fedotp import FedOTP  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def steps_per_second(method: FedOTP, batch: Batch, steps: int, reencode: bool, device: torch.device) -> float:
    """Client updates per second over ``steps`` steps of one batch."""
    clip, model = method.backbones[0], method.model
    if reencode:
        def loss(m, b: Batch) -> torch.Tensor:
            with torch.no_grad():
                tokens = clip.encode_image_tokens(b.x)
            return F.cross_entropy(m(tokens), b.y)
    else:
        loss = method.client.loss
    settings = TrainSettings(1, len(batch.y), {"name": "sgd", "lr": 1e-3, "momentum": 0.9, "weight_decay": 5e-4})
    keys = method.trainable_keys(0)
    named = dict(model.named_parameters())

    def run(n: int) -> None:
        data = ClientData(0, n * len(batch.y), lambda: iter([batch] * n), torch.Generator(), settings)
        run_epochs([named[k] for k in keys], data, settings, 1, lambda b: loss(model, b))

    run(2)  # warm-up
    _sync(device)
    t = time.perf_counter()
    run(steps)
    _sync(device)
    return steps / (time.perf_counter() - t)


def ot_seconds(method: FedOTP, batch: Batch, steps: int, device: torch.device) -> float:
    """Seconds per step spent in the OT solver alone (the plans of every image and class of the batch)."""
    from fedcore.methods.fedotp import solve_plans

    with torch.no_grad(), autocast_for(batch.x):
        text = method.model.text_features()
        patches = F.normalize(batch.extras[TOKENS][:, 1:].float(), dim=-1)
        cost = 1 - torch.einsum("bmd,nkd->bkmn", patches, text.float())
    solve_plans(cost, method.params)
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        solve_plans(cost, method.params)
    _sync(device)
    return (time.perf_counter() - t) / steps


def iterations(method: FedOTP, batch: Batch) -> int:
    """How many iterations the batch's slowest OT problem runs (the solver's cost grows with it)."""
    from fedcore.methods.fedotp import solve_plans

    with torch.no_grad(), autocast_for(batch.x):
        patches = F.normalize(batch.extras[TOKENS][:, 1:].float(), dim=-1)
        cost = 1 - torch.einsum("bmd,nkd->bkmn", patches, method.model.text_features().float())
    final = solve_plans(cost, method.params)
    for n in range(1, int(method.params["ot_max_iter"])):
        if torch.equal(solve_plans(cost, {**method.params, "ot_max_iter": n}), final):
            return n
    return int(method.params["ot_max_iter"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="clip_mini")
    ap.add_argument("--weights", default=None, help="a weight file (default: random weights)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    device, name = bench_device(a.threads, a.device)
    torch.manual_seed(0)
    clip = prompt_adapter(build_backbone(a.arch, a.weights)).to(device)
    method = FedOTP(clip, a.classes, {}, class_names=[f"class {k}" for k in range(a.classes)])
    method.model.to(device).train()
    cfg = input_cfg(a.arch)
    raw = torch.randint(0, 256, (a.batch, 32, 32, 3), dtype=torch.uint8, device=device)
    x = to_model_input(raw, cfg["img_size"], cfg["mean"], cfg["std"])
    with torch.no_grad(), autocast_for(x):
        tokens = clip.encode_image_tokens(x).half()  # as the artifact stores them
    batch = Batch(x, torch.randint(0, a.classes, (a.batch,), device=device), torch.arange(a.batch, device=device),
                  {TOKENS: tokens})
    print(f"# FedOTP {a.arch}, K={a.classes}, batch {a.batch}, {a.steps} steps, {name}")
    cached = steps_per_second(method, batch, a.steps, reencode=False, device=device)
    again = steps_per_second(method, batch, a.steps, reencode=True, device=device)
    ot = ot_seconds(method, batch, a.steps, device)
    print(f"cached tokens: {cached:.1f} steps/s ({1e3 / cached:.1f} ms/step)")
    print(f"re-encode:     {again:.1f} steps/s ({1e3 / again:.1f} ms/step); cached is x{cached / again:.2f}")
    print(f"OT solver:     {1e3 * ot:.1f} ms/step, {iterations(method, batch)} iterations (the slowest problem)")


if __name__ == "__main__":
    main()
