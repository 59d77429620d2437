"""Frozen-backbone CLS features, computed once per dataset and block and cached as pipeline artifacts.

SGPT's ``Select`` query h_θ(x) is the final-norm CLS token of the frozen, un-prompted ViT after block
``b`` (the last block for label shift, block 5 of 12 for feature shift; spec sgpt §1.4). Nothing trained
changes it, so the rule ``features`` computes it once per (backbone, dataset, block) for the train
and test splits; SGPT runs, the Table 4 clustering, the K-Means reference (Fig. 6a) and Fig. 3 read the
same file. ``layer_features`` serves the t-SNE figure (Fig. 5), which needs several blocks at once; both
run ``PromptedViT.cls_features`` (the one ViT token forward, without prompts).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from fedcore.backbones.prompted import PromptedViT, attention_backend
from fedcore.backbones.vit import backbone_info, build_vit
from fedcore.data.arrays import load_bundle
from fedcore.engine.data import DeviceSplit, InputPipeline
from fedcore.io import atomic_path, read_npz
from fedcore.runtime.device import pick_device

FORMAT = "fedcore-select-queries-v1"


@torch.no_grad()
def layer_features(backbone: PromptedViT, split: DeviceSplit, pipeline: InputPipeline, blocks: list[int],
                   batch_size: int = 256, indices: torch.Tensor | None = None,
                   bf16: bool = True) -> dict[int, np.ndarray]:
    """Final-norm CLS token after each of ``blocks`` (0-indexed), float32 (N, D) per block, no prompts; computed
    under bf16 autocast on CUDA unless ``bf16`` is False (then fp32 throughout)."""
    idx = torch.arange(len(split.y), device=split.y.device) if indices is None else indices
    out: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
    for chunk in idx.split(batch_size):
        x = pipeline(split.x[chunk])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and x.is_cuda):
            # one pass to the deepest block; the final norm is applied to each requested block's tokens
            for b, cls in backbone.cls_features(x, blocks).items():
                out[b].append(cls.float().cpu())
    return {b: torch.cat(v).numpy() if v else np.zeros((0, backbone.embed_dim), np.float32) for b, v in out.items()}


def compute_select_queries(dataset_path: str | Path, arch: str, weights: str | Path | None, block: int,
                           out_path: str | Path, device: str = "auto", threads: int | None = None) -> None:
    """Write the frozen Select queries (raw final-norm CLS after ``block``) of both splits to ``out_path``."""
    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    # full fp32 also inside CUDA kernels: TF32 (cuDNN's default for convolutions: the patch embedding) keeps
    # bf16-like 10-bit mantissas; this job computes nothing else
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    vit = build_vit(arch, weights)
    depth = len(vit.blocks)
    if not 0 <= block < depth:
        raise ValueError(f"select_block={block} is outside {arch}'s blocks 0..{depth - 1}")
    info = backbone_info(vit)
    backbone = PromptedViT(vit).to(dev)
    pipeline = InputPipeline(info["img_size"], info["mean"], info["std"])
    bundle = load_bundle(dataset_path)
    feats = {}
    with attention_backend(dev):
        for name, ds in (("train", bundle.train), ("test", bundle.test)):
            # fp32 (SGPT audit, issue 12 item 5): a query decides a group assignment by a key's argmax; one pass
            # per dataset is cheap, so bf16 rounding never decides it
            feats[name] = layer_features(backbone, DeviceSplit.from_arrays(ds, dev), pipeline, [block],
                                         bf16=False)[block]
    # the dataset relative to the working directory: the file's bytes then do not depend on where the
    # checkout lies (an absolute path would make two otherwise equal result directories differ)
    meta = {"format": FORMAT, "arch": arch, "block": block, "dataset": Path(os.path.relpath(dataset_path)).as_posix()}
    with atomic_path(out_path, suffix=".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, train=feats["train"], test=feats["test"], meta=json.dumps(meta))


def read_select_queries(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, test, meta) of a select-queries file, with a clear error for a wrong or missing file."""
    if path is None or not Path(path).exists():
        raise FileNotFoundError(f"select-queries file {path} does not exist (built by the features rule as artifact cls_block<b>)")
    z = read_npz(path, "features")
    meta = json.loads(str(z["meta"])) if "meta" in z else {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file (format {meta.get('format')!r})")
    return z["train"], z["test"], meta


def load_select_queries(path: str | Path | None, n_train: int, n_test: int, block: int | None,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test queries on ``device``, checked against the dataset's sizes and the method's block."""
    train, test, meta = read_select_queries(path)
    if (len(train), len(test)) != (n_train, n_test):
        raise ValueError(f"{path}: {len(train)}/{len(test)} train/test queries, the dataset has {n_train}/{n_test}")
    if block is not None and int(meta["block"]) != int(block):
        raise ValueError(f"{path} holds block {meta['block']} queries, the method's select_block is {block}")
    return torch.from_numpy(train).to(device), torch.from_numpy(test).to(device)


def build(args: tuple[int, ...], dataset_path, arch, weights, out_path, device, threads) -> None:
    """Artifact ``cls_block<b>`` (fedcore.artifacts): the frozen CLS after block args[0] for both splits."""
    compute_select_queries(dataset_path, arch, weights, args[0], out_path, device=device, threads=threads)


def load(args: tuple[int, ...], path, n_train: int, n_test: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Artifact ``cls_block<b>``'s train and test rows, checked against the dataset's sizes and the block."""
    return load_select_queries(path, n_train, n_test, args[0], device)
