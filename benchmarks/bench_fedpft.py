"""Seconds per FedPFT round, clients one by one vs trained together (fedcore/engine/together.py's phases).

    python benchmarks/bench_fedpft.py                      # mini: resnet8_pft_mini, 8 clients x 30 images, batch 30
    python benchmarks/bench_fedpft.py --clients 40 --images 500 --batch 100 --arch resnet8_pft --side 32 \
        --queue 65536 --epochs 1 --feature-epochs 1 --rounds 1 --only fedpft  # paper shapes, 1 of the 5 epochs

Prints sec/round for FedPFT (one by one, together), FedPFT w/o L_Con (both) and FedAvg (the engine's default
update, one by one): the same clients, data and budget, after a warm-up round of two clients (torch's first
optimiser step imports ~5 s of modules once per process). ``--epochs`` below the paper's 5 measures part of a
round; the figure printed is per round of those epochs (multiply by 5 / epochs for a full round: every step of a
phase costs the same). CUDA when present (synchronised around each round).

Measured (CPU, one thread, the shared 2-core machine; "quiet": load average below 1, else the process's CPU time
is the figure to compare):
* mini (resnet8_pft_mini, 16 px, 8 clients x 30 images, batch 30, R = 5: 40 client steps), quiet machine, 3 runs:
  one by one 0.84-1.25 s/round, together 0.70-0.90 s: 0.97x, 1.30x, 1.40x; FedPFT w/o L_Con (2 runs): 0.19-0.25 s
  vs 0.17 s: 1.09x, 1.42x; FedAvg 0.27 s.
* resnet8_pft_mini, 16 px, 40 clients x 500 images, batch 100, R = 1 (200 steps), quiet: 8.4 s vs 10.9 s: 0.77x.
* paper shapes (resnet8_pft, 32 px, 40 clients x 500 images, batch 100, K = 65536), R = 1 (200 of a round's 1,000
  client steps), load 5-10: process CPU 76.0 s (380 ms/step; wall 162 s) vs 188.9 s (945 ms/step; wall 300 s):
  0.40x.

So on the CPU batching is about even at mini (the run-to-run spread is as large as the gain) and 1.3-2.5x slower
at larger shapes: the vmapped convolutions become grouped convolutions (per-client weights), slower on the CPU
than the clients' plain ones, and the functional enqueue copies the 40 queues (1.3 GB at K = 65536) every step. ``client_batching: auto``
therefore trains one by one on the CPU, and on CUDA too until the batched round is measured faster there
(``fedpft.BATCHED_FASTER_ON``, empty; benchmarks/bench_together.py measured 5.3x for the 40 ResNet-8 clients alone on
an H100, not FedPFT's round). A paper round on this CPU
one by one: ~76 s x 5 = 380 s of CPU, so 1,000 rounds ~4.4 days a run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.backbones.registry import build_backbone, prompt_adapter  # noqa: E402
from fedcore.engine.data import Batch, InputPipeline  # noqa: E402
from fedcore.engine.optim import ClientData, TrainSettings  # noqa: E402
from fedcore.engine.roles import RoundInfo  # noqa: E402
from fedcore.methods import method_class  # noqa: E402


def _clients(n: int, images: int, batch: int, side: int, pipe: InputPipeline, device: torch.device
             ) -> list[ClientData]:
    """Random images per client, batches in a fixed order, views drawn from each client's generator."""
    out = []
    for c in range(n):
        g = torch.Generator().manual_seed(c)
        x = pipe(torch.randint(0, 256, (images, side, side, 3), generator=g, dtype=torch.uint8).to(device))
        y = torch.randint(0, 10, (images,), generator=g).to(device)
        gen = torch.Generator().manual_seed(100 + c)
        batches = (lambda x=x, y=y: (Batch(x[i:i + batch], y[i:i + batch], torch.arange(i, i + batch), {})
                                     for i in range(0, len(y), batch)))
        out.append(ClientData(c, images, batches, gen, None, lambda t, name, gen=gen: pipe.augment(t, name, gen),
                              pipeline=pipe))
    return out


def _round(method, server, states: dict, datas: list[ClientData], settings: TrainSettings, together: bool,
           r: int) -> dict:
    """One round of ``datas``' clients (fit one by one, or fit_together), then the aggregation."""
    downs = [method.strategy.configure(server, d.cid) for d in datas]
    if together:
        outs = method.client.fit_together([states[d.cid] for d in datas], downs, datas, settings)
    else:
        outs = []
        for d, down in zip(datas, downs):
            method.model_for(d.cid).train()
            outs.append(method.client.fit(d.cid, states[d.cid], down, d, settings))
    for d, (st, _) in zip(datas, outs):
        states[d.cid] = st
    return method.strategy.aggregate(RoundInfo(r, len(states), 1.0, 0), server, [res for _, res in outs])


def sec_per_round(name: str, params: dict, together: bool, args: argparse.Namespace, device: torch.device
                  ) -> tuple[float, float]:
    """Mean wall and process-CPU seconds of a round (every client's fit, then the aggregation) over ``args.rounds``
    after a warm-up (on a shared CPU the process's CPU time is the fairer figure)."""
    torch.manual_seed(0)
    method = method_class(name)(prompt_adapter(build_backbone(args.arch)).to(device), 10, params)
    method.to(device)  # as fedcore/train.py does
    pipe = InputPipeline(args.side, (0.5,) * 3, (0.5,) * 3)
    datas = _clients(args.clients, args.images, args.batch, args.side, pipe, device)
    settings = TrainSettings(args.epochs, args.batch, {"name": "sgd", "lr": 0.1, "momentum": 0.9})
    server = method.strategy.init_state(args.clients)
    states = {c: method.client.init_state(c) for c in range(args.clients)}
    server = _round(method, server, states, datas[:2], settings, together, 0)  # warm-up
    wall = cpu = 0.0
    for r in range(args.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        server = _round(method, server, states, datas, settings, together, r + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = wall + time.perf_counter() - start, cpu + time.process_time() - start_cpu
    return wall / args.rounds, cpu / args.rounds


def main() -> None:
    """Parse arguments, time the methods both ways."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet8_pft_mini")
    ap.add_argument("--side", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--batch", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=5, help="local epochs R (the paper's 5)")
    ap.add_argument("--feature-epochs", type=int, default=4, help="R_f")
    ap.add_argument("--queue", type=int, default=64, help="MoCo queue size K (mini: 64; the paper's 65536)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=("fedpft", "without_con", "fedavg"), nargs="*", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pft = {"queue_size": args.queue, "feature_epochs": args.feature_epochs}
    steps = args.clients * args.epochs * -(-args.images // args.batch)
    print(f"{device}, {args.threads} thread(s), {args.clients} clients x {args.images} images, batch {args.batch}, "
          f"{args.arch} at {args.side} px, R = {args.epochs}: {steps} client steps a round")
    for key, label, name, params, modes in (
            ("fedpft", "FedPFT", "fedpft", pft, (False, True)),
            ("without_con", "FedPFT w/o L_Con", "fedpft", {**pft, "contrastive": False}, (False, True)),
            ("fedavg", "FedAvg", "fedavg", {}, (False,))):
        if args.only is not None and key not in args.only:
            continue
        secs = {mode: sec_per_round(name, params, mode, args, device) for mode in modes}
        line = "  ".join(f"{'together' if m else 'one by one'} {w:8.2f} s/round, CPU {c:8.2f} s "
                         f"({1000 * c / steps:6.1f} ms/step)" for m, (w, c) in secs.items())
        ratio = (f"  speed-up wall {secs[False][0] / secs[True][0]:.2f}x, CPU {secs[False][1] / secs[True][1]:.2f}x"
                 if True in secs else "")
        print(f"{label:18s} {line}{ratio}", flush=True)


if __name__ == "__main__":
    main()
