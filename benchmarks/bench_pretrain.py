"""Measure vit_mini pretraining throughput (fwd+bwd images/s) and, optionally, linear-probe quality on digits.

    python benchmarks/bench_pretrain.py --threads 2                 # throughput, 3,000 images x 3 epochs
    python benchmarks/bench_pretrain.py --threads 2 --probe         # + 30-epoch pretrain and a linear probe
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

from fedcore.backbones import vit as vit_mod
from fedcore.backbones.images import to_model_input
from fedcore.backbones.pretrain import pretrain_vit
from fedcore.backbones.vit import backbone_info, build_vit
from fedcore.data.arrays import ArrayDataset, DatasetBundle


def digits_16(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 8x8 digits as uint8 (N,16,16,3) RGB (2x nearest upsampling), shuffled."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images * (255.0 / 16.0)).round().astype(np.uint8)
    x = np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)
    x = np.repeat(x[..., None], 3, axis=-1)
    perm = np.random.default_rng(seed).permutation(len(x))
    return x[perm], d.target[perm].astype(np.int64)


def bundle_of(x: np.ndarray, y: np.ndarray) -> DatasetBundle:
    """A bundle whose pretrain split is (x, y); train/test are placeholders."""
    ds = ArrayDataset(x, y)
    return DatasetBundle(train=ds, test=ds, pretrain=ds, meta=dict(classes=[str(i) for i in range(10)]))


@torch.no_grad()
def features(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """CLS features of uint8 images."""
    info = backbone_info(model)
    inp = to_model_input(torch.from_numpy(x), info["img_size"], info["mean"], info["std"])
    return model.eval()(inp).numpy()


def main() -> None:
    """Parse args, run the benchmark, print the numbers."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="vit_mini")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--n", type=int, default=3000, help="images per epoch (digits tiled)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mlp-ratio", type=float, default=None, help="override vit_mini's mlp_ratio (exploration)")
    ap.add_argument("--depth", type=int, default=None, help="override vit_mini's depth (exploration)")
    ap.add_argument("--probe", action="store_true", help="also pretrain 30 epochs and linear-probe on held-out digits")
    args = ap.parse_args()

    if args.mlp_ratio is not None or args.depth is not None:
        vit_mod.ARCHS[args.arch] = cfg = copy.deepcopy(vit_mod.ARCHS[args.arch])
        if args.mlp_ratio is not None:
            cfg["kwargs"]["mlp_ratio"] = args.mlp_ratio
        if args.depth is not None:
            cfg["kwargs"]["depth"] = args.depth
    x, y = digits_16()
    reps = -(-args.n // len(x))
    xt, yt = np.concatenate([x] * reps)[: args.n], np.concatenate([y] * reps)[: args.n]
    st = pretrain_vit(bundle_of(xt, yt), arch=args.arch, epochs=args.epochs, batch_size=args.batch_size,
                      threads=args.threads, progress=False, device=args.device)
    print(f"{args.arch} kwargs={vit_mod.ARCHS[args.arch].get('kwargs')} threads={args.threads} "
          f"batch={args.batch_size} device={args.device}: {st['images_per_s']:.0f} images/s fwd+bwd "
          f"({st['images']} images in {st['train_seconds']:.2f} s)")

    if args.probe:
        from sklearn.linear_model import LogisticRegression

        n_pre, n_probe = 1000, 400  # pretrain / probe-train / probe-test (the remaining 397) are disjoint
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "vit_mini.pt"
            t0 = time.perf_counter()
            st = pretrain_vit(bundle_of(x[:n_pre], y[:n_pre]), arch=args.arch, epochs=30,
                              batch_size=args.batch_size, threads=args.threads, progress=False,
                              out_path=out, device=args.device)
            secs = time.perf_counter() - t0
            model = build_vit(args.arch, out)
        torch.set_num_threads(args.threads)
        f_tr, f_te = features(model, x[n_pre : n_pre + n_probe]), features(model, x[n_pre + n_probe :])
        probe = LogisticRegression(max_iter=2000).fit(f_tr, y[n_pre : n_pre + n_probe])
        acc = probe.score(f_te, y[n_pre + n_probe :])
        rand = build_vit(args.arch)  # same probe on a random-init backbone, for reference
        r_acc = LogisticRegression(max_iter=2000).fit(features(rand, x[n_pre : n_pre + n_probe]),
                                                      y[n_pre : n_pre + n_probe]).score(features(rand, x[n_pre + n_probe :]), y[n_pre + n_probe :])
        print(f"30-epoch pretrain on {n_pre} images: {secs:.1f} s, train acc {st['train_acc']:.3f}; "
              f"linear probe ({n_probe} train / {len(x) - n_pre - n_probe} test): {acc:.3f} "
              f"(random-init backbone: {r_acc:.3f}, chance 0.10)")

if __name__ == "__main__":
    main()
