"""The probe files the report reads: their formats, the readers the figures use, and the writer of the panel files.

Kept apart from the probes that compute them (tsne.py, transport.py, run_features.py: backbones, methods, runs), so
that a table or figure imports only this to read one (its rule's code inputs, fedcore/code_inputs.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.io import atomic_path, read_npz

TSNE_FORMAT = "fedcore-tsne-v1"                   # tsne.py: SGPT Fig. 5, FedOTP Fig. A5
TRANSPORT_FORMAT = "fedcore-transport-plans-v1"   # transport.py: FedOTP Fig. A4
RUN_TSNE_FORMAT = "fedcore-run-tsne-v1"           # run_features.py: FedPFT Figs. 2, 3
ATTENTION_FORMAT = "fedcore-attention-v1"         # run_features.py: FedPFT Fig. 6


def read_tsne(path: str | os.PathLike) -> dict[str, Any]:
    """The probe's blocks, labels, per-block embeddings and meta, with a clear error for a wrong file."""
    z = read_npz(path, "tsne_embedding")
    meta = json.loads(str(z["meta"])) if "meta" in z else {}
    if meta.get("format") != TSNE_FORMAT:
        raise ValueError(f"{path} is not a {TSNE_FORMAT} file (format {meta.get('format')!r})")
    blocks = [int(b) for b in z["blocks"]]
    return {"blocks": blocks, "labels": z["labels"], "meta": meta,
            "embeddings": {b: z[f"emb_{b}"] for b in blocks if f"emb_{b}" in z}}


def read_transport_plans(path: str | os.PathLike) -> dict[str, Any]:
    """The probe's images, labels, clients, plans (runs, n, M, 2) and meta, with a clear error for a wrong file."""
    z = read_npz(path, "transport_plans")
    meta = json.loads(str(z["meta"])) if "meta" in z else {}
    if meta.get("format") != TRANSPORT_FORMAT:
        raise ValueError(f"{path} is not a {TRANSPORT_FORMAT} file (format {meta.get('format')!r})")
    return {"images": z["images"], "labels": z["labels"], "clients": z["clients"], "plans": z["plans"],
            "meta": meta}


def save_panels(out_path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write a panel file (run t-SNE, attention) atomically: its arrays and its meta as JSON."""
    with atomic_path(Path(out_path), suffix=".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, meta=json.dumps(meta), **arrays)


def read_panels(path: str | os.PathLike, fmt: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of a probe file of format ``fmt``, with a clear error for a wrong file."""
    z = read_npz(path, "run_tsne" if fmt == RUN_TSNE_FORMAT else "attention")
    meta = json.loads(str(z["meta"])) if "meta" in z else {}
    if meta.get("format") != fmt:
        raise ValueError(f"{path} is not a {fmt} file (format {meta.get('format')!r})")
    return meta, {k: v for k, v in z.items() if k != "meta"}
