"""Frozen CLIP image tokens (CLS + M patches, joint space), computed once per dataset: artifact ``clip_tokens``.

FedOTP's image encoder is frozen, so each image's ``PromptedCLIP.encode_image_tokens`` (spec fedotp §1.3) never
changes: rule ``features`` computes it for the train and test splits, and every FedOTP-family run (and zero-shot
CLIP, the CLS token) reads the file instead of running the image tower. Inputs get the deterministic test-time
transform only (InputPipeline: resize + normalise), not the official code's random-resized-crop training
augmentation (the methods record this as a deviation).

Stored float16, (N, 1+M, embed_dim) per split, in one .npz. Sizes: mini (clip_mini, digits) 942 + 315 images
x 17 x 64 x 2 B = 2.7 MB; paper, CIFAR-100 with ViT-B/16: 60,000 x 197 x 512 x 2 B = 12.1 GB (train 10.1 GB),
which the build holds once in host memory and a run loads onto its GPU (float16 keeps it there at half the fp32
size; the methods cast batches to float32). float16 keeps ~3 significant digits: cosine similarities move by
~1e-3 at most, below what the OT's λ = 0.1 resolves.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from fedcore.backbones.clip import PromptedCLIP
from fedcore.backbones.registry import build_backbone, prompt_adapter, split_tag
from fedcore.backbones.vit import backbone_info
from fedcore.data.arrays import load_bundle
from fedcore.engine.data import DeviceSplit, InputPipeline
from fedcore.io import atomic_path, read_npz
from fedcore.runtime.device import pick_device

FORMAT = "fedcore-clip-tokens-v1"
RULE = "features"
DTYPE = np.float16


@torch.no_grad()
def image_tokens(clip: PromptedCLIP, split: DeviceSplit, pipeline: InputPipeline,
                 batch_size: int = 256) -> np.ndarray:
    """float16 (N, 1+M, embed_dim) ``encode_image_tokens`` of every image of `split`."""
    out = np.empty((len(split.y), 1 + clip.num_patches, clip.embed_dim), DTYPE)
    for start in range(0, len(split.y), batch_size):
        x = pipeline(split.x[start : start + batch_size])
        # computed in fp32 on every device (one pass per dataset), so the file's float16 rounding is the only error
        out[start : start + len(x)] = clip.encode_image_tokens(x).cpu().numpy().astype(DTYPE)
    return out


def compute_clip_tokens(dataset_path: str | Path, arch: str, weights: str | Path | None, out_path: str | Path,
                        device: str = "auto", threads: int | None = None) -> None:
    """Write the frozen CLIP image tokens of both splits of a dataset to ``out_path``."""
    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    # no TF32 inside CUDA kernels either (cuDNN's default for the patch-embedding convolution), as the Select queries
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    name, tag = split_tag(arch)
    model = build_backbone(name, weights, tag)
    info = backbone_info(model)
    clip = prompt_adapter(model)
    if not isinstance(clip, PromptedCLIP):
        raise ValueError(f"artifact clip_tokens needs a CLIP backbone; {arch!r} is a {info.get('family', 'vit')}")
    clip = clip.to(dev)
    pipeline = InputPipeline(info["img_size"], info["mean"], info["std"])
    bundle = load_bundle(dataset_path)
    tokens = {name: image_tokens(clip, DeviceSplit.from_arrays(ds, dev), pipeline)
              for name, ds in (("train", bundle.train), ("test", bundle.test))}
    # the dataset relative to the working directory, as for the select queries (same bytes wherever the checkout is)
    meta = {"format": FORMAT, "arch": arch, "num_patches": clip.num_patches, "embed_dim": clip.embed_dim,
            "dataset": Path(os.path.relpath(dataset_path)).as_posix()}
    with atomic_path(out_path, suffix=".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, train=tokens["train"], test=tokens["test"], meta=json.dumps(meta))


def load_clip_tokens(path: str | Path | None, n_train: int, n_test: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test tokens (float16, (N, 1+M, D)) on ``device``, checked against the dataset's sizes."""
    if path is None or not Path(path).exists():
        raise FileNotFoundError(f"CLIP tokens file {path} does not exist (built by the features rule as artifact "
                                f"clip_tokens)")
    z = read_npz(path, RULE)
    meta = json.loads(str(z["meta"])) if "meta" in z else {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file (format {meta.get('format')!r})")
    train, test = z["train"], z["test"]
    want = (1 + int(meta["num_patches"]), int(meta["embed_dim"]))
    for name, arr, n in (("train", train, n_train), ("test", test, n_test)):
        if arr.ndim != 3 or arr.shape[1:] != want or len(arr) != n:
            raise ValueError(f"{path}: {name} tokens have shape {arr.shape}, expected ({n}, {want[0]}, {want[1]}) "
                             f"(the dataset's {name} size, 1 + {meta['num_patches']} patches, {meta['arch']}'s "
                             f"embed_dim); rebuild it with the features rule")
    return torch.from_numpy(train).to(device), torch.from_numpy(test).to(device)


def build(args: tuple[int, ...], dataset_path, arch, weights, out_path, device, threads) -> None:
    """Artifact ``clip_tokens`` (fedcore.artifacts): the frozen CLIP CLS + patch tokens of both splits."""
    compute_clip_tokens(dataset_path, arch, weights, out_path, device=device, threads=threads)


def load(args: tuple[int, ...], path, n_train: int, n_test: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Artifact ``clip_tokens``' train and test tokens, checked against the dataset's sizes and the stored shapes."""
    return load_clip_tokens(path, n_train, n_test, device)
