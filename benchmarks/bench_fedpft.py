"""Seconds per FedPFT round at mini on the CPU (clients one after another), and where the time goes.

    python benchmarks/bench_fedpft.py                      # resnet8_pft_mini, 8 clients x 30 images, batch 30, R = 5
    python benchmarks/bench_fedpft.py --clients 40 --images 500 --batch 100 --arch resnet8_pft --side 32

Prints sec/round for FedPFT, FedPFT w/o L_Con and FedAvg (the same clients, data and budget), after one warm-up
round (torch's first optimiser step imports ~5 s of modules once per process).

A batched path over the 40 clients (torch.func.functional_call + vmap, as fedcore/engine/together.py does for
the default update) would need from the engine:
* a client update made of several phases with different trainable sets and one optimiser per round: together.py
  knows one loss over one trainable set; it would take a list of (trainable keys, epochs, loss) phases;
* per-client method-owned tensors stacked along the client axis and threaded through the step (the MoCo queue
  and pointer, the key encoder's parameters and BatchNorm buffers), with the EMA and the enqueue as functional
  updates (the enqueue's write position differs per client only after unequal batch counts);
* per-client augmentation generators: every client's views drawn from its own generator, then stacked (the
  draws are cheap; the warps are one batched grid_sample over clients x batch);
* BatchNorm in train mode under vmap (functional running statistics per client: torch.func.replace_all_batch_norm_
  modules_ or buffers passed in and returned), for φ and the key encoder;
* gradients only where each branch routes them: torch.no_grad branches become stop-gradients inside the vmapped
  function (detach), which vmap supports.
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


def _clients(n: int, images: int, batch: int, side: int, pipe: InputPipeline) -> list[ClientData]:
    """Random images per client, batches in a fixed order, views drawn from each client's generator."""
    out = []
    for c in range(n):
        g = torch.Generator().manual_seed(c)
        x = pipe(torch.randint(0, 256, (images, side, side, 3), generator=g, dtype=torch.uint8))
        y = torch.randint(0, 10, (images,), generator=g)
        gen = torch.Generator().manual_seed(100 + c)
        batches = (lambda x=x, y=y: (Batch(x[i:i + batch], y[i:i + batch], torch.arange(i, i + batch), {})
                                     for i in range(0, len(y), batch)))
        out.append(ClientData(c, images, batches, gen, None, lambda t, name, gen=gen: pipe.augment(t, name, gen)))
    return out


def sec_per_round(name: str, params: dict, args: argparse.Namespace) -> float:
    """Mean seconds of a round (every client's fit, then the aggregation) over ``args.rounds`` after a warm-up."""
    torch.manual_seed(0)
    method = method_class(name)(prompt_adapter(build_backbone(args.arch)), 10, params)
    pipe = InputPipeline(args.side, (0.5,) * 3, (0.5,) * 3)
    datas = _clients(args.clients, args.images, args.batch, args.side, pipe)
    settings = TrainSettings(5, args.batch, {"name": "sgd", "lr": 0.1, "momentum": 0.9})
    server = method.strategy.init_state(args.clients)
    states = {c: method.client.init_state(c) for c in range(args.clients)}
    times = []
    for r in range(args.rounds + 1):
        start = time.perf_counter()
        results = []
        for d in datas:
            method.model_for(d.cid).train()
            states[d.cid], res = method.client.fit(d.cid, states[d.cid], method.strategy.configure(server, d.cid), d,
                                                   settings)
            results.append(res)
        server = method.strategy.aggregate(RoundInfo(r + 1, args.clients, 1.0, 0), server, results)
        times.append(time.perf_counter() - start)
    return sum(times[1:]) / args.rounds


def main() -> None:
    """Parse arguments, time the three methods."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet8_pft_mini")
    ap.add_argument("--side", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--batch", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for label, name, params in (("FedPFT", "fedpft", {"queue_size": 64, "feature_epochs": 4}),
                                ("FedPFT w/o L_Con", "fedpft", {"contrastive": False, "feature_epochs": 4}),
                                ("FedAvg", "fedavg", {})):
        s = sec_per_round(name, params, args)
        steps = args.clients * 5 * -(-args.images // args.batch)
        print(f"{label:18s} {s:7.2f} s/round  ({1000 * s / steps:.1f} ms/step, {steps} steps a round)")


if __name__ == "__main__":
    main()
