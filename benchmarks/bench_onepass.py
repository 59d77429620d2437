"""A round's clients one by one, in one pass and vmapped, side by side in one process: images/s per method family.

    python benchmarks/bench_onepass.py                                    # mini shapes (vit_mini, clip_mini), CPU
    python benchmarks/bench_onepass.py --preset paper --amp               # paper shapes (ViT-B/16, CLIP ViT-B/16), GPU
    python benchmarks/bench_onepass.py --families sgpt fedotp --clients 5 --steps 10

Per family, its paper's clients per round (``--clients`` overrides) and batch size, random weights and random
batches (the speed does not depend on them): the round's local updates (one epoch of ``--steps`` batches a client)
trained one by one (``Client.fit`` per client, as the engine without a together path), in one pass
(fedcore/engine/onepass.py) and, where the client's update allows it, vmapped (fedcore/engine/together.py). Each
image counts once per pass over it (SGPT's two blocks are two passes). FLOP/image is counted once per family with
torch's FlopCounterMode over one client's step (forward and backward, input gradients through the frozen backbone);
the share of peak is against ``--peak-tflops`` (989: the dense bf16 peak of an H100 SXM or H200) on CUDA. Paths
run interleaved, best of ``--repeats``; on the CPU timed by the process's CPU time (one thread), which other jobs of
a shared machine do not inflate as they do wall time.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _device import bench_device  # noqa: E402 (benchmarks/, the script's own folder, is first on sys.path)
from fedcore.backbones.images import to_model_input  # noqa: E402
from fedcore.backbones.prompted import attention_backend  # noqa: E402
from fedcore.backbones.registry import build_backbone, input_cfg, prompt_adapter  # noqa: E402
from fedcore.engine import batching  # noqa: E402
from fedcore.engine.data import Batch  # noqa: E402
from fedcore.engine.optim import ClientData, TrainSettings  # noqa: E402
from fedcore.engine.precision import autocast_for  # noqa: E402
from fedcore.runtime.determinism import deterministic_kernels  # noqa: E402
from fedcore.methods import method_class  # noqa: E402
from fedcore.methods.clip_prompt import TOKENS  # noqa: E402
from fedcore.methods.sgpt import QUERY  # noqa: E402

#: family -> (method, params, backbone kind, the paper's clients per round, its batch size, passes over a batch)
FAMILIES: dict[str, tuple[str, dict, str, int, int, int]] = {
    "fedvpt": ("fedvpt", {}, "vit", 5, 40, 1),        # SGPT's baselines: CIFAR-100, 100 clients x 0.05, batch 40
    "fedvpt_d": ("fedvpt_d", {}, "vit", 5, 40, 1),
    "fedpr": ("fedpr", {}, "vit", 5, 40, 1),
    "pfedpg": ("pfedpg", {}, "vit", 5, 40, 1),
    "local": ("local", {}, "vit", 5, 40, 1),
    "sgpt": ("sgpt", {}, "vit", 5, 40, 2),            # Block I and Block II
    "head_tune": ("head_tune", {}, "features", 5, 40, 1),
    "fedhpl": ("fedhpl", {}, "vit", 5, 16, 1),        # FedHPL homogeneous ViT-B: 5 clients, batch 16
    "coop": ("coop", {}, "clip", 10, 32, 1),          # FedOTP's CIFAR-100: 100 clients x 0.1, batch 32
    "promptfl": ("promptfl", {}, "clip", 10, 32, 1),
    "fedotp": ("fedotp", {}, "clip", 10, 32, 1),
}
PRESETS = {"mini": {"vit": "vit_mini", "clip": "clip_mini", "classes": 10},
           "paper": {"vit": "vit_base_patch16_224", "clip": "clip_vit_b16", "classes": 100}}
MINI_SGPT = {"groups": 5, "shared_blocks": [0], "group_blocks": [1, 2], "select_block": 3}  # the mini s=10 blocks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def setup(family: str, preset: str, batch: int, device: torch.device, params: dict | None = None
          ) -> tuple[Any, Batch]:
    """(method, one batch) of ``family`` at ``preset``'s backbone, random weights; artifacts are random (cached);
    ``params``: the method's params instead of the family's (and mini SGPT's blocks)."""
    name, family_params, kind, _, _, _ = FAMILIES[family]
    p = PRESETS[preset]
    arch = p["clip"] if kind == "clip" else p["vit"]
    torch.manual_seed(0)
    backbone = prompt_adapter(build_backbone(arch)).to(device)
    cls = method_class(name)
    if params is None:
        params = MINI_SGPT if name == "sgpt" and preset == "mini" else family_params
    classes = p["classes"]
    kw = {"class_names": [f"class {i}" for i in range(classes)]} if kind == "clip" else {}
    method = cls(backbone, classes, dict(params), **kw).to(device)
    cfg = input_cfg(arch)
    raw = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, device=device)
    x = to_model_input(raw, cfg["img_size"], cfg["mean"], cfg["std"])
    extras: dict[str, torch.Tensor] = {}
    if kind == "features":
        with torch.no_grad():
            x = method.frozen_features()(x).float()
    if kind == "clip":
        with torch.no_grad(), autocast_for(x):
            extras[TOKENS] = backbone.encode_image_tokens(x).half()
    if QUERY in cls.artifacts(method.params):
        extras[QUERY] = torch.randn(batch, backbone.embed_dim, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    return method, Batch(x, y, torch.arange(batch, device=device), extras)


def round_inputs(method: Any, b: Batch, clients: int, steps: int, settings: TrainSettings):
    """(states, downlinks, data) of ``clients`` clients, each ``steps`` copies of the batch."""
    server = method.strategy.init_state(clients)
    states = [method.client.init_state(c) for c in range(clients)]
    downs = [method.strategy.configure(server, c) for c in range(clients)]
    datas = [ClientData(c, len(b.y) * steps, lambda: iter([b] * steps), torch.Generator(), settings)
             for c in range(clients)]
    return states, downs, datas


def paths(method: Any, device: torch.device) -> dict[str, Any]:
    """The ways to train a round: one by one always; one pass and vmap where the client offers them."""
    client, model = method.client, method.model
    out: dict[str, Any] = {}

    def one_by_one(states, downs, datas, settings):
        for s, d, data in zip(states, downs, datas):
            model.train()
            client.fit(data.cid, s, d, data, settings)
    out["one by one"] = one_by_one
    saved = batching.ONE_PASS_ON
    batching.ONE_PASS_ON = frozenset({device.type})
    try:
        plan = client.together(device.type, model)
    finally:
        batching.ONE_PASS_ON = saved
    if plan.fit is not None and "one pass" in plan.how:
        out["one pass"] = plan.fit
    batching.ONE_PASS_ON = frozenset()
    try:
        vplan = client.together("cpu", model)   # the vmapped path as the CPU offers it (CUDA refuses attention)
    finally:
        batching.ONE_PASS_ON = saved
    if vplan.fit is not None and "vmap" in vplan.how:
        out["vmap"] = vplan.fit
    return out


def flops_per_image(method: Any, b: Batch, settings: TrainSettings, amp: bool) -> float:
    """FLOP of one client's one-step update per image (every pass counted), by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    states, downs, datas = round_inputs(method, b, 1, 1, settings)
    with FlopCounterMode(display=False) as counter, torch.autocast(b.x.device.type, dtype=torch.bfloat16,
                                                                    enabled=amp):
        method.model.train()
        method.client.fit(0, states[0], downs[0], datas[0], settings)
    return counter.get_total_flops() / len(b.y)


def bench(family: str, preset: str, clients: int | None, batch: int | None, steps: int, device: torch.device,
          amp: bool, repeats: int, only: list[str] | None, compile_mode: str | None = None,
          params: dict | None = None) -> dict[str, Any]:
    """Images/s of each path for one round of ``family`` (best of ``repeats``), and FLOP/image; ``compile_mode``:
    the one pass's step under ``torch.compile`` (the engine's ``RunSpec.compile``); ``params``: see ``setup``."""
    _, _, _, paper_clients, paper_batch, passes = FAMILIES[family]
    clients, batch = clients or paper_clients, batch or paper_batch
    method, b = setup(family, preset, batch, device, params)
    settings = TrainSettings(1, batch, {"name": "sgd", "lr": 0.01, "momentum": 0.9})
    compiled = TrainSettings(1, batch, settings.optimizer, compile=compile_mode)
    result: dict[str, Any] = {"family": family, "clients": clients, "batch": batch,
                              "flop_per_image": flops_per_image(method, b, settings, amp)}
    ways = {name: fn for name, fn in paths(method, device).items() if not only or name in only}
    # the CPU: this process's CPU time, not wall time (a shared machine's other jobs preempt it; one thread)
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    best = dict.fromkeys(ways, float("inf"))
    for rep in range(repeats + 1):  # the first is a warm-up (kernels, allocator); paths interleaved, so that a
        for name, fn in ways.items():  # shared machine's drift does not favour one of them
            states, downs, datas = round_inputs(method, b, clients, 1 if rep == 0 else steps, settings)
            states = copy.deepcopy(states)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                _sync(device)
                t0 = clock()
                fn(states, downs, datas, compiled if name == "one pass" else settings)
                _sync(device)
            if rep:
                best[name] = min(best[name], clock() - t0)
    result.update({name: passes * clients * batch * steps / t for name, t in best.items()})
    return result


def main() -> None:
    """Parse arguments, print one line per family."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mini")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--clients", type=int, default=None, help="clients per round (default: the paper's)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: the paper's)")
    ap.add_argument("--steps", type=int, default=5, help="batches per client in the timed round")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per path (best taken)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--amp", action="store_true", help="bf16 autocast (the engine's CUDA precision)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (CUDA only)")
    ap.add_argument("--paths", nargs="+", default=None, choices=["one by one", "one pass", "vmap"])
    ap.add_argument("--compile", default=None, choices=["default", "reduce-overhead", "max-autotune"],
                    help="the one pass's step under torch.compile (reduce-overhead: CUDA graphs; GPU)")
    ap.add_argument("--nondeterministic", action="store_true",
                    help="CUDA: allow nondeterministic kernels (config deterministic: false); default: strict mode, "
                         "as the pipeline's CUDA jobs run")
    a = ap.parse_args()
    device, name = bench_device(a.threads)
    print(f"# preset {a.preset}, {a.steps} steps a client, {name}, torch {torch.__version__}, amp={a.amp}, "
          f"compile={a.compile}, deterministic={not a.nondeterministic}")
    print(f"# {'family':10s} {'C':>3s} {'B':>3s} {'GFLOP/img':>9s} | images/s: {'one by one':>10s} {'one pass':>9s} "
          f"{'vmap':>9s} | pass/1x1  pass/vmap | share of peak (one by one, one pass)")
    with attention_backend(device), deterministic_kernels(device, not a.nondeterministic):
        for family in a.families:
            r = bench(family, a.preset, a.clients, a.batch, a.steps, device, a.amp, a.repeats, a.paths, a.compile)
            one, onep, vm = (r.get(k) for k in ("one by one", "one pass", "vmap"))
            fmt = lambda v: f"{v:9.1f}" if v else f"{'-':>9s}"  # noqa: E731
            ratio = lambda u, v: f"{u / v:8.2f}x" if u and v else f"{'-':>9s}"  # noqa: E731
            share = ""
            if device.type == "cuda":
                tf = [v * r["flop_per_image"] / 1e12 / a.peak_tflops for v in (one, onep) if v]
                share = ", ".join(f"{s:.1%}" for s in tf)
            print(f"  {family:10s} {r['clients']:3d} {r['batch']:3d} {r['flop_per_image'] / 1e9:9.3f} | "
                  f"{'':10s}{fmt(one):>10s} {fmt(onep)} {fmt(vm)} | {ratio(onep, one)} {ratio(onep, vm)} | {share}",
                  flush=True)


if __name__ == "__main__":
    main()
