"""Measure tiny-ViT pretraining throughput (fwd+bwd images/s) and, optionally, linear-probe quality on digits.

    python benchmarks/bench_pretrain.py --threads 2            # throughput: 3 epochs over the pretrain split
    python benchmarks/bench_pretrain.py --threads 2 --probe    # + full pretrain and a linear probe on digits

Data: the embedded `digits` bundle (fedcore.data.embedded) when importable, else sklearn's digits upsampled
to 16x16 with a 30/50/20 pretrain/train/test split.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fedcore.backbones import vit as vit_mod  # noqa: E402
from fedcore.backbones.images import to_model_input  # noqa: E402
from fedcore.backbones.pretrain.supervised import pretrain_vit  # noqa: E402
from fedcore.backbones.vit import backbone_info, build_vit  # noqa: E402
from fedcore.data.arrays import ArrayDataset, DatasetBundle  # noqa: E402


def sklearn_digits_bundle(seed: int = 0) -> DatasetBundle:
    """sklearn's 8x8 digits as uint8 (N,16,16,3) (2x nearest upsampling), split 30/50/20 pretrain/train/test."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images * (255.0 / 16.0)).round().astype(np.uint8)
    x = np.repeat(np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)[..., None], 3, axis=-1)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], d.target[perm].astype(np.int64)
    a, b = int(0.3 * len(x)), int(0.8 * len(x))
    return DatasetBundle(pretrain=ArrayDataset(x[:a], y[:a]), train=ArrayDataset(x[a:b], y[a:b]),
                         test=ArrayDataset(x[b:], y[b:]), meta=dict(classes=[str(i) for i in range(10)]))


def digits_bundle() -> tuple[DatasetBundle, str]:
    """The pipeline's embedded digits bundle if that module is available, else the sklearn stand-in."""
    try:
        from fedcore.data.embedded import build_embedded

        return build_embedded("digits"), "fedcore.data.embedded digits"
    except ImportError:
        return sklearn_digits_bundle(), "sklearn digits (stand-in)"


@torch.no_grad()
def features(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """CLS features of uint8 images."""
    info = backbone_info(model)
    inp = to_model_input(torch.from_numpy(x), info["img_size"], info["mean"], info["std"])
    return model.eval()(inp).numpy()


def probe_accuracy(model: torch.nn.Module, bundle: DatasetBundle) -> float:
    """Logistic-regression linear probe: fit on train features, accuracy on test."""
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(max_iter=3000).fit(features(model, bundle.train.x), bundle.train.y)
    return float(clf.score(features(model, bundle.test.x), bundle.test.y))


def main() -> None:
    """Parse args, run the benchmark, print the numbers."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="vit_mini")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3, help="epochs of the throughput run")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mlp-ratio", type=float, default=None, help="override the arch's mlp_ratio (exploration)")
    ap.add_argument("--probe", action="store_true", help="also run a full pretrain and a linear probe")
    ap.add_argument("--probe-epochs", type=int, default=30)
    args = ap.parse_args()

    if args.mlp_ratio is not None:
        vit_mod.ARCHS[args.arch] = cfg = copy.deepcopy(vit_mod.ARCHS[args.arch])
        cfg["kwargs"]["mlp_ratio"] = args.mlp_ratio
    bundle, source = digits_bundle()
    hp = dict(batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay, threads=args.threads,
              progress=False, device=args.device)
    st = pretrain_vit(bundle, arch=args.arch, epochs=args.epochs, **hp)
    print(f"{args.arch} {vit_mod.ARCHS[args.arch].get('kwargs', '')} on {source} pretrain split "
          f"({len(bundle.pretrain)} images), threads={args.threads}, batch={args.batch_size}, device={args.device}: "
          f"{st['images_per_s']:.0f} images/s fwd+bwd ({st['images']} images in {st['train_seconds']:.2f} s)")

    if args.probe:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "backbone.pt"
            t0 = time.perf_counter()
            st = pretrain_vit(bundle, arch=args.arch, epochs=args.probe_epochs, out_path=out, **hp)
            secs = time.perf_counter() - t0
            model = build_vit(args.arch, out)
        torch.set_num_threads(args.threads)
        acc = probe_accuracy(model, bundle)
        torch.manual_seed(0)
        rand_acc = probe_accuracy(build_vit(args.arch), bundle)  # same probe on a random-init backbone
        print(f"{args.probe_epochs}-epoch pretrain: {secs:.1f} s ({st['images_per_s']:.0f} images/s), clean train "
              f"acc {st['train_acc']:.3f}; linear probe on {len(bundle.train)} train / {len(bundle.test)} test: "
              f"{acc:.3f} (random-init backbone {rand_acc:.3f}, chance {1 / bundle.num_classes:.2f})")


if __name__ == "__main__":
    main()
