"""FedOTP Fig. A4 probe: the transport plans of a few test images to their true class's global and local prompts,
from the final prompts of runs that differ in the OT mass gamma (spec fedotp §5 Fig. A4).

Each image is one client's test image; its plan uses that client's prompts [P_g, P_l,i] as the run saved them
(final.pt: ``global`` holds ``ctx_global``, ``personal[i]`` its ``ctx_local``), which is how the client is scored.
The images are picked without randomness: the first ``per_client`` test images of each listed client, each of a
class not yet shown. The plans (n, M, 2) are stored raw (float32, rows = patches in raster order, column 0 =
global, column 1 = local); the figure normalises and overlays them. A run that is missing or not configured keeps
its place with a status, so the figure shows the gap. Each run's method is built as training builds it
(``fedcore.train.build_run``, from the run's params and files), then given its final prompts.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcore.analysis.probe_files import TRANSPORT_FORMAT
from fedcore.backbones.clip import clip_classnames
from fedcore.backbones.registry import build_backbone, prompt_adapter, split_tag
from fedcore.backbones.vit import backbone_info
from fedcore.data.arrays import load_bundle
from fedcore.engine.data import InputPipeline
from fedcore.engine.roles import load_state
from fedcore.io import atomic_path
from fedcore.methods.fedotp import transport_plans
from fedcore.partition.file import Partition
from fedcore.runtime.device import pick_device
from fedcore.train import RunFiles, build_run

OK = "ok"
MISSING_RUN = "missing run"


def pick_images(test_parts: list[np.ndarray], labels: np.ndarray, clients: list[int], per_client: int
                ) -> list[tuple[int, int]]:
    """(client, test index) pairs: per listed client, its first ``per_client`` test images of classes not yet
    picked (a client's own classes, in its test order)."""
    picks, seen = [], set()
    for c in clients:
        if not 0 <= c < len(test_parts):
            raise ValueError(f"transport-plan figure: client {c} is not among the partition's {len(test_parts)} "
                             "clients; set the figure's clients")
        taken = 0
        for idx in test_parts[c]:
            if taken == per_client:
                break
            if int(labels[idx]) not in seen:
                seen.add(int(labels[idx]))
                picks.append((c, int(idx)))
                taken += 1
    if not picks:
        raise ValueError(f"transport-plan figure: clients {clients} have no test images")
    return picks


def client_prompts(final: dict, cid: int) -> dict[str, torch.Tensor]:
    """Client ``cid``'s [global, local] prompt tensors from a run's final.pt, with a clear error where absent."""
    shared = final.get("global") or {}
    personal = (final.get("personal") or {}).get(cid) or {}
    state = {**shared, **personal}
    for key in ("ctx_global", "ctx_local"):
        if key not in state:
            raise ValueError(f"final.pt holds no {key!r} for client {cid} (keys: global {sorted(shared)}, "
                             f"personal {sorted(personal)}): not a FedOTP run")
    return state


def run_plans(method: Any, final: dict, tokens: torch.Tensor, labels: torch.Tensor, clients: list[int]
              ) -> np.ndarray:
    """(n, M, 2) plans of each image (tokens (n, 1+M, D)) to its class's prompts of its client, from ``final``."""
    model = method.model
    out = []
    for i, cid in enumerate(clients):
        load_state(model, client_prompts(final, cid))
        out.append(transport_plans(method, model, tokens[i : i + 1], labels[i : i + 1])[0])
    return torch.stack(out).float().cpu().numpy()


def built_method(args: dict[str, Any], device: torch.device) -> Any:
    """A run's method as training builds it (fedcore.train.build_run: its params, data, class names, artifacts),
    on ``device``; ``args``: the probe rule's load arguments of the run (its final prompts are loaded after)."""
    files = RunFiles(args["dataset_path"], args["partition_path"], (args["weights"],), (args["sha256"],),
                     artifacts=dict(args.get("artifacts", {})))
    return build_run(args["params"], args["identity"], args["arch"], files, device).method


def compute_transport_plans(dataset_path: str | os.PathLike, partition_path: str | os.PathLike, arch: str,
                            weights: str | os.PathLike | None, runs: list[dict[str, Any]], fig_cfg: dict[str, Any],
                            out_path: str | os.PathLike, device: str = "auto", threads: int | None = None) -> None:
    """Plans of the picked test images for every run of ``runs`` (dicts: label, variant, method (base), and ``run``:
    its build arguments with ``final_path``, or ``status``), saved as .npz with the images and the runs' statuses.
    The images' tokens come from the frozen CLIP of ``weights`` (the runs' own backbone)."""
    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    bundle = load_bundle(dataset_path)
    part = Partition.load(partition_path)
    clients = [int(c) for c in fig_cfg.get("clients", range(min(4, len(part.test))))]
    picks = pick_images(part.test, bundle.test.y, clients, int(fig_cfg.get("per_client", 1)))
    cids = [c for c, _ in picks]
    idx = np.asarray([i for _, i in picks], dtype=np.int64)
    name, tag = split_tag(arch)
    net = build_backbone(name, weights, tag)
    info = backbone_info(net)
    clip = prompt_adapter(net).to(dev)
    pipeline = InputPipeline(info["img_size"], info["mean"], info["std"])
    images = torch.from_numpy(bundle.test.x[idx]).to(dev)
    labels = torch.from_numpy(bundle.test.y[idx]).to(dev)
    with torch.no_grad():
        tokens = clip.encode_image_tokens(pipeline(images))
    side = int(round((tokens.shape[1] - 1) ** 0.5))
    if side * side != tokens.shape[1] - 1:
        raise ValueError(f"{tokens.shape[1] - 1} patch tokens do not form a square grid")
    plans, statuses = [], []
    for run in runs:
        args = run.get("run")
        if args is None or not Path(args["final_path"]).exists():
            statuses.append(run.get("status", MISSING_RUN) if args is None else MISSING_RUN)
            plans.append(np.full((len(picks), side * side, 2), np.nan, dtype=np.float32))
            continue
        plans.append(run_plans(built_method(args, dev), torch.load(args["final_path"], map_location=dev,
                                                                   weights_only=True), tokens, labels, cids))
        statuses.append(OK)
    meta = {"format": TRANSPORT_FORMAT, "arch": arch, "grid": [side, side], "runs": [r["label"] for r in runs],
            "methods": [r.get("variant", r["method"]) for r in runs], "status": statuses,
            "class_names": [clip_classnames(bundle.meta)[int(y)] for y in labels.tolist()]}
    with atomic_path(Path(out_path), suffix=".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, images=bundle.test.x[idx], labels=bundle.test.y[idx], index=idx,
                     clients=np.asarray(cids, dtype=np.int64), plans=np.stack(plans), meta=json.dumps(meta))
