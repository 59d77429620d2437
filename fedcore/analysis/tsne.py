"""SGPT Fig. 5 probe: t-SNE maps of frozen CLS features after several blocks, on a class-balanced subsample.

The backbone is the frozen, un-prompted pretrained ViT (``artifacts.select_queries.layer_features``: final-norm CLS
after each requested block, 0-indexed). Samples are balanced over the coarse labels (CIFAR-100's 20
superclasses; the dataset's classes when it has none). The embedding is computed here, once, so the
figure only draws it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.analysis.probe_files import TSNE_FORMAT
from fedcore.artifacts.select_queries import layer_features
from fedcore.backbones.prompted import PromptedViT, attention_backend
from fedcore.backbones.registry import check_sha256
from fedcore.backbones.vit import backbone_info, build_vit
from fedcore.data.arrays import load_bundle
from fedcore.engine.data import DeviceSplit, InputPipeline
from fedcore.io import atomic_path
from fedcore.partition.file import Partition
from fedcore.runtime.device import pick_device



def balanced_subsample(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """Sorted indices of up to `per_class` samples of every label, drawn without replacement (seeded)."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    picks = [rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in np.unique(labels)]
    return np.sort(np.concatenate(picks)) if picks else np.zeros(0, dtype=np.int64)


def tsne_embedding(features: np.ndarray, perplexity: float, seed: int) -> np.ndarray:
    """2-D t-SNE (scikit-learn, PCA init, fixed seed) of `features`; perplexity capped below the sample count."""
    from sklearn.manifold import TSNE

    n = len(features)
    if n < 3:
        raise ValueError(f"t-SNE needs at least 3 samples, got {n}")
    perp = min(float(perplexity), (n - 1) / 3.0)  # sklearn requires perplexity < n; keep a margin
    tsne = TSNE(n_components=2, perplexity=perp, init="pca", random_state=seed, learning_rate="auto")
    return tsne.fit_transform(np.asarray(features, dtype=np.float32)).astype(np.float32)


def compute_tsne(dataset_path: str | os.PathLike, arch: str, weights: str | os.PathLike | None, fig_cfg: dict[str, Any],
                 out_path: str | os.PathLike, device: str = "auto", threads: int | None = None,
                 sha256: str | None = None) -> None:
    """Features of a class-balanced subsample after each configured block, embedded by t-SNE, saved as .npz; the
    weight file is checked against ``sha256`` (registry.check_sha256) before any work."""
    import torch

    if weights is not None:
        check_sha256(Path(weights), arch, sha256)
    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    bundle = load_bundle(dataset_path)
    split = getattr(bundle, fig_cfg.get("split", "test"))
    kind = "coarse" if split.coarse is not None else "fine"
    labels = np.asarray(split.coarse if kind == "coarse" else split.y, dtype=np.int64)
    names = bundle.meta.get("coarse_classes" if kind == "coarse" else "classes") or []
    seed = int(fig_cfg.get("seed", 0))
    idx = balanced_subsample(labels, int(fig_cfg["per_class"]), seed)

    vit = build_vit(arch, weights)
    depth = len(vit.blocks)
    blocks = [int(b) for b in fig_cfg["blocks"]]
    bad = [b for b in blocks if not 0 <= b < depth]
    if bad:
        raise ValueError(f"t-SNE blocks {bad} are outside {arch}'s blocks 0..{depth - 1}: set figures.<name>.blocks "
                         f"in config/scales/<scale>.yaml")
    info = backbone_info(vit)
    backbone = PromptedViT(vit).to(dev)
    pipeline = InputPipeline(info["img_size"], info["mean"], info["std"])
    with attention_backend(dev):
        feats = layer_features(backbone, DeviceSplit.from_arrays(split, dev), pipeline, blocks,
                               indices=torch.from_numpy(idx).to(dev))
    arrays = {f"emb_{b}": tsne_embedding(feats[b], float(fig_cfg.get("perplexity", 30)), seed) for b in blocks}
    counts = np.bincount(labels[idx], minlength=int(labels.max(initial=-1)) + 1)
    meta = {"format": TSNE_FORMAT, "arch": arch, "depth": depth, "split": fig_cfg.get("split", "test"),
            "label_kind": kind, "label_names": list(names), "per_class": int(fig_cfg["per_class"]),
            "per_class_drawn": counts.tolist(),
            "perplexity": float(fig_cfg.get("perplexity", 30)), "seed": seed}
    with atomic_path(Path(out_path), suffix=".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, blocks=np.asarray(blocks, dtype=np.int64), labels=labels[idx], index=idx,
                     meta=json.dumps(meta), **arrays)


def client_coarse_labels(coarse: np.ndarray, train_parts: list[np.ndarray]) -> np.ndarray:
    """Each client's coarse class: the most frequent coarse label of its train samples (the only one under FedOTP's
    coarse split, spec fedotp §3.2e)."""
    out = []
    for c, idx in enumerate(train_parts):
        if len(idx) == 0:
            raise ValueError(f"client {c} has no train samples: no coarse class to colour it by")
        out.append(int(np.bincount(np.asarray(coarse)[idx]).argmax()))
    return np.asarray(out, dtype=np.int64)


def prompt_tsne(final_path: str | os.PathLike, dataset_path: str | os.PathLike, partition_path: str | os.PathLike,
                fig_cfg: dict[str, Any], out_path: str | os.PathLike) -> None:
    """FedOTP Fig. A5 probe: t-SNE of every client's final personal prompt (``prompt``, default ctx_local,
    flattened), labelled by the client's coarse class; written in this module's format (one map, index 0)."""
    import torch

    bundle = load_bundle(dataset_path)
    if bundle.train.coarse is None:
        raise ValueError(f"{dataset_path} has no coarse labels: the prompt t-SNE colours clients by coarse class")
    part = Partition.load(partition_path)
    key = fig_cfg.get("prompt", "ctx_local")
    personal = torch.load(final_path, map_location="cpu", weights_only=True).get("personal") or {}
    missing = [c for c in range(len(part.train)) if key not in (personal.get(c) or {})]
    if missing:
        raise ValueError(f"{final_path}: clients {missing[:5]} have no personal {key!r} (a method with personal "
                         "prompts is needed, e.g. fedotp)")
    feats = np.stack([personal[c][key].float().flatten().numpy() for c in range(len(part.train))])
    labels = client_coarse_labels(bundle.train.coarse, part.train)
    seed = int(fig_cfg.get("seed", 0))
    perplexity = float(fig_cfg.get("perplexity", 30))
    emb = tsne_embedding(feats, perplexity, seed)
    meta = {"format": TSNE_FORMAT, "arch": f"final {key} ({feats.shape[1]}-d)", "split": "",
            "label_kind": "coarse", "label_names": list(bundle.meta.get("coarse_classes") or []),
            "perplexity": min(perplexity, (len(feats) - 1) / 3.0), "seed": seed, "panel_titles": [key],
            "unit": "clients"}
    with atomic_path(Path(out_path), suffix=".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, blocks=np.asarray([0], dtype=np.int64), labels=labels, index=np.arange(len(feats)),
                     meta=json.dumps(meta), emb_0=emb)
