"""Speed of the CLIP prompt adapter, and the mini CLIP's pretraining and zero-shot accuracy.

    python benchmarks/bench_clip.py              # speed at mini on CPU (and ViT-B/16 if a GPU is present)
    python benchmarks/bench_clip.py --pretrain   # + pretrain clip_mini as config/backbones.yaml says, zero-shot
    python benchmarks/bench_clip.py --pretrain --set epochs=8 lr=2e-3   # explore its settings

Speed: images/s of ``encode_image_tokens`` (no grad: the features artifact) and text prompts/s of
``encode_text_with_context`` forward + backward into the context (what FedOTP runs every step: 2 prompts x K
classes, n_ctx 16), random weights. Zero-shot: "a photo of a {class}." on the test split of digits,
digits_styles4 and digits_styles6, classes "zero".."nine" (chance 0.10).

Measured (2-core machine shared with other jobs, one thread, torch 2.14.1; bs 256 images, 2 x 10 prompts):
    clip_mini CPU: encode_image_tokens ~2,800 images/s (vit_mini's forward, same conditions: ~3,000);
    encode_text_with_context fwd+bwd ~1,200 prompts/s (K = 10: ~60 steps/s of FedOTP's text side).
    clip_mini pretraining (epochs 10): ~55-60 s; zero-shot test accuracy digits 0.810, digits_styles4 0.683,
    digits_styles6 0.689 (315 test images each; deterministic: two runs gave the same numbers).
No GPU figures yet (none on this machine): run this file on one to fill in ViT-B/16's.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from fedcore.backbones.pretrain import pretrain  # noqa: E402
from fedcore.backbones.pretrain.clip import zero_shot_accuracy  # noqa: E402
from fedcore.backbones.prompted import attention_backend  # noqa: E402
from fedcore.backbones.registry import build_backbone, input_cfg, prompt_adapter  # noqa: E402
from fedcore.data.embedded import build_embedded  # noqa: E402


def _rate(fn, items: int, seconds: float = 2.0, device: torch.device = torch.device("cpu")) -> float:
    """Items per second of fn() (one warm-up call, then repeated for about `seconds`)."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    sync()
    return n * items / (time.perf_counter() - t0)


def speed(arch: str, device: torch.device, batch: int, classes: int, n_ctx: int = 16, prompts: int = 2) -> dict:
    """images/s of encode_image_tokens and prompts/s of encode_text_with_context fwd+bwd for random weights."""
    torch.manual_seed(0)
    adapter = prompt_adapter(build_backbone(arch)).to(device)
    x = torch.randn(batch, 3, adapter.img_size, adapter.img_size, device=device)
    ids, eot = adapter.tokenize_classnames([f"class {i}" for i in range(classes)], n_ctx)
    ids, eot = ids.to(device), eot.to(device)
    ctx = torch.nn.Parameter(torch.randn(prompts, n_ctx, adapter.text_width, device=device) * 0.02)
    amp = dict(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def image() -> None:
        with torch.no_grad(), torch.autocast(**amp):
            adapter.encode_image_tokens(x)

    def text() -> None:
        with torch.autocast(**amp):
            adapter.encode_text_with_context(ctx, ids, eot).float().square().sum().backward()

    with attention_backend(device):
        return dict(images_per_s=_rate(image, batch, device=device),
                    prompts_per_s=_rate(text, prompts * classes, device=device))


def zero_shot(settings: dict, threads: int) -> None:
    """Pretrain clip_mini with `settings` as rule pretrain_backbone does; print the zero-shot accuracies."""
    digits = build_embedded("digits")
    with tempfile.TemporaryDirectory() as tmp:
        stats = pretrain(digits, "clip_mini", "digits", seed=0, out_path=Path(tmp) / "w.pt", threads=threads,
                         **settings)
        model = build_backbone("clip_mini", Path(tmp) / "w.pt")
    print(f"clip_mini pretraining: {stats['train_seconds']:.1f} s, loss {stats['final_loss']:.3f}, logit scale "
          f"{stats['logit_scale']:.1f}, zero-shot on its pretrain split {stats['zero_shot_acc']:.3f}")
    info = input_cfg("clip_mini")
    for name in ("digits", "digits_styles4", "digits_styles6"):
        b = digits if name == "digits" else build_embedded(name)
        acc = zero_shot_accuracy(model, torch.from_numpy(b.test.x), torch.from_numpy(b.test.y), b.meta["clip_names"],
                                 info)
        print(f"  zero-shot test accuracy {name}: {acc:.3f} ({len(b.test)} images)")


def main() -> None:
    """Parse args; print the speeds, then (with --pretrain) the zero-shot accuracies."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pretrain", action="store_true", help="pretrain clip_mini and measure zero-shot accuracy")
    ap.add_argument("--set", nargs="*", default=[], help="override clip_mini's pretrain settings, key=value")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"clip_mini CPU ({args.threads} thread): {speed('clip_mini', torch.device('cpu'), 256, 10)}")
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        print(f"clip_vit_b16 {torch.cuda.get_device_name()}: bf16, bs 256, K = 100 classes: "
              f"{speed('clip_vit_b16', gpu, 256, 100)}")
    if args.pretrain:
        entry = yaml.safe_load((ROOT / "config" / "backbones.yaml").read_text())["clip_mini"]["pretrain"]
        zero_shot({**entry, **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}}, args.threads)


if __name__ == "__main__":
    main()
