"""FedPFT Figs. 2, 3 and 6: t-SNE maps of trained runs' features and τ's attention weights.

* ``write_run_tsne`` (Figs. 2, 3; spec fedpft §1.12d): per panel, one run's feature kind (``linear_probe.
  feature_maps``: ``phi`` = φ(x) for Fig. 2, ``p_kappa`` / ``p_rho`` = τ's output with that prompt set for Fig. 3)
  of every client's test images, each client's own model, embedded by t-SNE (scikit-learn, PCA init, the
  figure's seed); labels and client ids are kept for colour and marker.
* ``write_attention`` (Fig. 6, §1.12e): per panel, the attention weights of τ's output token over [f, prompts]
  (averaged over heads) for the first ``samples`` test images of one client: rows sum to 1.

A panel whose method the experiment does not run is kept with status ``not configured`` (drawn as such).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from fedcore.analysis.linear_probe import feature_maps
from fedcore.analysis.probe_files import ATTENTION_FORMAT, RUN_TSNE_FORMAT, save_panels
from fedcore.analysis.trained_run import load_trained_run
from fedcore.analysis.tsne import tsne_embedding
from fedcore.data.arrays import load_bundle

OK, NOT_CONFIGURED, NO_FEATURE = "ok", "not configured", "no such feature"


def run_features(run, feature: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(features, labels, client ids) of every client's test images with its own model; None when the run's model
    has no such feature kind."""
    feats, labels, clients = [], [], []
    for c in range(run.num_clients):
        maps = feature_maps(run.client_model(c))
        if feature not in maps:
            return None
        f, y = run.apply(maps[feature], "test", c)
        feats.append(f.cpu().numpy())
        labels.append(y.cpu().numpy())
        clients.append(np.full(len(y), c, dtype=np.int64))
    return np.concatenate(feats), np.concatenate(labels), np.concatenate(clients)


def write_run_tsne(panels: list[dict[str, Any]], perplexity: float, seed: int, out_path: str | os.PathLike,
                   device: str = "auto") -> dict[str, Any]:
    """Embed each panel's features; ``panels``: dicts with label, method, feature and either ``run`` (the keyword
    arguments of ``load_trained_run``) or ``status``. Writes one .npz; returns its meta."""
    arrays: dict[str, np.ndarray] = {}
    meta_panels = []
    class_names: list[str] = []
    for i, p in enumerate(panels):
        entry = {k: p[k] for k in ("label", "method", "feature")}
        if "run" not in p:
            meta_panels.append({**entry, "status": p.get("status", NOT_CONFIGURED)})
            continue
        run = load_trained_run(device=device, **p["run"])
        got = run_features(run, p["feature"])
        if got is None:
            meta_panels.append({**entry, "status": NO_FEATURE})
            continue
        feats, labels, clients = got
        arrays[f"emb_{i}"] = tsne_embedding(feats, perplexity, seed)
        arrays[f"labels_{i}"], arrays[f"clients_{i}"] = labels, clients
        meta_panels.append({**entry, "status": OK, "clients": run.num_clients, "points": int(len(labels))})
        class_names = class_names or _class_names(p["run"]["dataset_path"])
    meta = {"format": RUN_TSNE_FORMAT, "panels": meta_panels, "perplexity": float(perplexity), "seed": int(seed),
            "class_names": class_names}
    save_panels(out_path, arrays, meta)
    return meta


def attention_weights(run, cid: int, prompts: str, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights (n, 1 + n_prompts), labels) of τ's output token over [f, prompts] for client ``cid``'s first
    ``samples`` test images (``prompts``: p_kappa | p_rho; averaged over heads)."""
    model = run.client_model(cid)
    tau, p = getattr(model, "tau", None), getattr(model, prompts, None)
    if tau is None or p is None:
        raise ValueError(f"method {run.method.name}: its model has no τ or no {prompts} (FedPFT's attention maps)")
    if not 0 <= cid < run.num_clients:
        raise ValueError(f"client {cid} is not one of the run's {run.num_clients} clients")
    idx = run.test_idx[cid][:samples]
    x = run.pipeline(run.test.x[idx])
    with torch.no_grad():
        w = tau.attention(model.net(x).float(), p.float())
    return w.float().cpu().numpy(), run.test.y[idx].cpu().numpy()


def write_attention(panels: list[dict[str, Any]], client: int, samples: int, out_path: str | os.PathLike,
                    device: str = "auto") -> dict[str, Any]:
    """Each panel's attention weights (see ``attention_weights``); panels as in ``write_run_tsne`` with ``prompts``
    instead of ``feature``. Writes one .npz; returns its meta."""
    arrays: dict[str, np.ndarray] = {}
    meta_panels = []
    for i, p in enumerate(panels):
        entry = {k: p[k] for k in ("label", "method", "prompts")}
        if "run" not in p:
            meta_panels.append({**entry, "status": p.get("status", NOT_CONFIGURED)})
            continue
        run = load_trained_run(device=device, **p["run"])
        arrays[f"weights_{i}"], arrays[f"labels_{i}"] = attention_weights(run, client, p["prompts"], samples)
        meta_panels.append({**entry, "status": OK})
    meta = {"format": ATTENTION_FORMAT, "panels": meta_panels, "client": int(client), "samples": int(samples)}
    save_panels(out_path, arrays, meta)
    return meta


def _class_names(dataset_path: str | os.PathLike) -> list[str]:
    return [str(c) for c in load_bundle(dataset_path).meta.get("classes") or []]
