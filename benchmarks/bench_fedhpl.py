"""One FedHPL round on paper shapes: images/s of each client backbone's local update and upload pass.

    python benchmarks/bench_fedhpl.py                                  # mini: vit_mini_s/vit_mini/vit_mini_l, CPU
    python benchmarks/bench_fedhpl.py --setting hetvit --amp           # paper: ViT-S/B/L at 224 px (GPU, bf16)
    python benchmarks/bench_fedhpl.py --setting hetres --amp           # paper: ResNet-18/34/50 + 3-px pad prompts

Random weights (the speed does not depend on them), CIFAR-10 shapes (32-px images resized on the device to the
backbone's input, 10 classes), batch 16 (spec §2). Per distinct backbone it times the real client update (CE + KD
towards a teacher for every class: forward, backward, SGD step) and the no-grad upload pass, then estimates one
round of the paper (5 clients x 10,000 images each: local epoch + upload pass + scoring the 10,000-image test set).
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
from fedcore.backbones.prompted import attention_backend  # noqa: E402
from fedcore.backbones.registry import build_backbone, input_cfg, prompt_adapter  # noqa: E402
from fedcore.engine.data import Batch  # noqa: E402
from fedcore.engine.optim import ClientData, TrainSettings  # noqa: E402
from fedcore.methods.fedhpl import FedHPL  # noqa: E402

SETTINGS = {
    "mini": ("vit_mini_s", "vit_mini", "vit_mini_l"),
    "minires": ("resnet_mini_18", "resnet_mini_34", "resnet_mini_50"),
    "hetvit": ("vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224"),
    "hetres": ("resnet18", "resnet34", "resnet50"),
}
CLIENT_BACKBONES = [0, 1, 2, 1, 0]  # Table 4's order: S, B, L, B, S (18, 34, 50, 34, 18)
CLASSES, PER_CLIENT, TEST = 10, 10_000, 10_000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_backbone(method: FedHPL, cid: int, arch: str, batch: int, steps: int, device: torch.device,
                   amp: bool) -> tuple[float, float]:
    """(train images/s, upload images/s) of client ``cid``'s update on ``arch``."""
    cfg = input_cfg(arch)
    raw = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, device=device)
    b = Batch(to_model_input(raw, cfg["img_size"], cfg["mean"], cfg["std"]),
              torch.randint(0, CLASSES, (batch,), device=device), torch.arange(batch, device=device), {})
    teacher = {"model": {"teacher": torch.randn(CLASSES, CLASSES, device=device),
                         "teacher_mask": torch.ones(CLASSES, device=device)}}
    settings = TrainSettings(1, batch, {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4})
    model = method.model_for(cid)

    def data(n: int) -> ClientData:
        return ClientData(cid, batch * n, lambda: iter([b] * n), torch.Generator())

    def train(n: int) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            method.client.start(model, cid, method.client.init_state(cid), teacher)
            method.client.train(model, cid, {}, teacher, data(n), settings)

    def upload(n: int) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            method.client.local_logits(model, data(n))

    out = []
    for fn in (train, upload):
        fn(2)  # warm-up (kernels, allocator)
        _sync(device)
        t0 = time.perf_counter()
        fn(steps)
        _sync(device)
        out.append(batch * steps / (time.perf_counter() - t0))
    return out[0], out[1]


def main() -> None:
    """Parse arguments; print images/s per backbone and the estimated round time."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="mini")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--amp", action="store_true", help="bf16 autocast (GPU)")
    a = ap.parse_args()
    device, name = bench_device(a.threads)
    archs = SETTINGS[a.setting]
    torch.manual_seed(0)
    backbones = [prompt_adapter(build_backbone(arch)).to(device) for arch in archs]
    method = FedHPL(backbones, CLASSES, {}, CLIENT_BACKBONES).to(device)
    print(f"# FedHPL {a.setting}, batch {a.batch}, {a.steps} steps, {name}, amp={a.amp}")
    speed = {}
    with attention_backend(device):
        for i, arch in enumerate(archs):
            cid = CLIENT_BACKBONES.index(i)
            speed[i] = bench_backbone(method, cid, arch, a.batch, a.steps, device, a.amp)
            print(f"{arch:24s} train {speed[i][0]:9.1f} images/s   upload/eval {speed[i][1]:9.1f} images/s")
    round_s = sum(PER_CLIENT / speed[i][0] + (PER_CLIENT + TEST) / speed[i][1] for i in CLIENT_BACKBONES)
    print(f"estimated round (5 clients x {PER_CLIENT} train images, upload pass, {TEST} test images each, one "
          f"after another): {round_s:.0f} s")


if __name__ == "__main__":
    main()
