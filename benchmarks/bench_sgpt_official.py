"""SGPT's round: the official code's model beside ours, side by side in one process (issue 24's baseline).

    python benchmarks/bench_sgpt_official.py --official /path/to/SGPT                      # mini shapes, CPU
    python benchmarks/bench_sgpt_official.py --official /path/to/SGPT --preset paper --amp  # ViT-B/16 at 224, GPU

``--official`` is a checkout of github.com/ubc-tea/SGPT (its ``models/vit_models_pr.py`` is imported from there, never
copied here; the model of HEAD 213c95b), through fedcore/official_sgpt.py (which also stands in for
``ml_collections`` where that package is missing). tests/test_official_sgpt.py checks that the two models compute
the same numbers.

Both sides train the same round: ``--clients`` clients (the paper's CIFAR-100 setting: 5 of 100 per round), each
``--steps`` batches of ``--batch`` random images (the speed does not depend on them), in SGPT's two blocks: Block I
trains the head and the shared prompts (cross-entropy), Block II the head, the group prompts and the keys
(cross-entropy plus the key loss), with SGD (lr 0.01, momentum 0.9, weight decay 1e-5) over each block's tensors.
Both use random weights, the same blocks (shared 0-4, group 5-6, G = 20, query from the last block: the paper's
s = 50 setting; at ``--preset mini`` the default pipeline's vit_mini blocks) and precompute the Select query once
per image (the official model caches it by image index in its ``embedding_dict``; ours reads the ``cls_block``
artifact). Each image counts once per block, as bench_onepass.py counts. The official step is written here from
the spec's description of its ``train_local_twostage`` (shared/spec/official_code.md, A3); the model is theirs.

Printed: images/s of the official model (fp32 as it ships, and under bf16 autocast with ``--amp``), of ours one
client after another and in one pass, and ours over the official (the round-time ratio: the same images).
"""
from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _device import bench_device  # noqa: E402 (benchmarks/, the script's own folder, is first on sys.path)
import bench_onepass  # noqa: E402
from fedcore.backbones.prompted import attention_backend  # noqa: E402
from fedcore.runtime.determinism import deterministic_kernels  # noqa: E402
from fedcore.backbones.registry import arch_spec  # noqa: E402
from fedcore import official_sgpt  # noqa: E402
from fedcore.official_sgpt import mini_config, official_args, official_module  # noqa: E402

#: SGPT's blocks per preset: (G, shared blocks, group blocks), the official model's image side and arch
SETTINGS = {"mini": {"groups": 5, "shared": [0], "group": [1, 2], "select": 3, "arch": "vit_mini"},
            "paper": {"groups": 20, "shared": [0, 1, 2, 3, 4], "group": [5, 6], "select": 11,
                      "arch": "vit_base_patch16_224"}}


def official_model(vmp: types.ModuleType, preset: str, classes: int, device: torch.device) -> tuple[nn.Module, int]:
    """The official VisionTransformer_m at the preset's shapes (random weights, backbone frozen), and its image side."""
    s = SETTINGS[preset]
    spec = arch_spec(s["arch"])
    if preset == "paper":
        config, side = vmp.CONFIGS["ViT-B_16"], 224
    else:  # the official ViT with vit_mini's width, depth, heads and patches
        config = mini_config(spec.dim, spec.depth, spec.kwargs["num_heads"], spec.patch_size)
        side = spec.kwargs["img_size"]
    args = official_args(s["groups"], s["shared"], s["group"], device=device)
    torch.manual_seed(0)
    return official_sgpt.official_model(vmp, config, side, classes, args).to(device), side


def _block_params(model: nn.Module, block: int) -> list[nn.Parameter]:
    """Block I: the head and the shared prompts; Block II: the head, the group prompts and the keys."""
    head = list(model.head.parameters())
    if block == 1:
        return head + list(model.prompt_common.parameters())
    return head + list(model.prompt_embeddings.parameters()) + [model.prompt_keys]


def official_round(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clients: int, steps: int,
                   cache: dict[int, torch.Tensor]) -> None:
    """One round of ``clients`` local updates with the official model: Block I, then Block II, ``steps`` each."""
    index = torch.arange(len(y))
    for _ in range(clients):
        for block in (1, 2):
            model.selection = block == 2
            params = _block_params(model, block)
            opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-5)
            model.train()
            for _ in range(steps):
                out = model(x, index, cache) if block == 2 else model(x)
                loss = F.cross_entropy(out["logits"], y)
                if block == 2:
                    loss = loss + out["reduced_sim"]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()


def time_official(model: nn.Module, side: int, batch: int, classes: int, clients: int, steps: int, repeats: int,
                  amp: bool, device: torch.device) -> float:
    """Images/s of the official round (best of ``repeats`` after a warm-up that also fills the query cache)."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(batch, 3, side, side, generator=g).to(device) * 2 - 1
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    cache: dict[int, torch.Tensor] = {}
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    best = float("inf")
    for rep in range(repeats + 1):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            bench_onepass._sync(device)
            t0 = clock()
            official_round(model, x, y, clients, 1 if rep == 0 else steps, cache)
            bench_onepass._sync(device)
        if rep:
            best = min(best, clock() - t0)
    return 2 * clients * batch * steps / best


def main() -> None:
    """Parse arguments, print the official model's and ours images/s side by side."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--official", type=Path, required=True, help="a checkout of github.com/ubc-tea/SGPT")
    ap.add_argument("--preset", choices=sorted(SETTINGS), default="mini")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--amp", action="store_true", help="bf16 autocast for ours and (also) the official model")
    ap.add_argument("--nondeterministic", action="store_true",
                    help="CUDA: ours with nondeterministic kernels too (config deterministic: false); default: ours in "
                         "strict mode as the pipeline runs it, the official model as it ships (no such mode)")
    a = ap.parse_args()
    device, name = bench_device(a.threads)
    classes = bench_onepass.PRESETS[a.preset]["classes"]
    print(f"# SGPT round: {a.clients} clients x {a.steps} steps x batch {a.batch}, two blocks, preset {a.preset}, "
          f"{name}, torch {torch.__version__}, ours deterministic={not a.nondeterministic}")
    try:
        vmp = official_module(a.official.resolve())
    except FileNotFoundError as e:
        raise SystemExit(f"--official {e}") from None
    model, side = official_model(vmp, a.preset, classes, device)
    rows = {"official, fp32 (as shipped)": time_official(model, side, a.batch, classes, a.clients, a.steps,
                                                         a.repeats, False, device)}
    if a.amp:
        rows["official, bf16 autocast"] = time_official(model, side, a.batch, classes, a.clients, a.steps, a.repeats,
                                                        True, device)
    s = SETTINGS[a.preset]
    params = {"groups": s["groups"], "shared_blocks": s["shared"], "group_blocks": s["group"],
              "select_block": s["select"]}   # the same blocks on our side
    with attention_backend(device), deterministic_kernels(device, not a.nondeterministic):
        ours = bench_onepass.bench("sgpt", a.preset, a.clients, a.batch, a.steps, device, a.amp, a.repeats,
                                   ["one by one", "one pass"], params=params)
    rows.update({f"ours, {k}": ours[k] for k in ("one by one", "one pass") if k in ours})
    base = rows["official, fp32 (as shipped)"]
    for label, v in rows.items():
        print(f"  {label:30s} {v:10.1f} images/s  {v / base:6.2f}x the official as shipped", flush=True)


if __name__ == "__main__":
    main()
