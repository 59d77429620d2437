"""A finished training run rebuilt for post-hoc probes (FedPFT Tables 1, 4, 5, 8, Figs. 2, 3, 6).

The run's method is built as ``fedcore.train.train_run`` builds it (same params, data, partition and backbone), then
every tensor comes from the run's ``final.pt``: the server state and each client's state. ``client_model(c)`` loads
client c's model exactly as the engine's evaluation does (``Evaluator.load``: the global tensors, then the client's
own), in eval mode. Only single-backbone runs without per-sample artifacts or a method-owned backbone are supported
(what FedPFT's probes read); anything else is refused with a clear error.

``check_against_log`` compares each client's test accuracy of the rebuilt model with the accuracy the run logged in
its final round: a rebuild that does not reproduce the run is an error, not a silent difference.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from fedcore.engine.data import Batch, DeviceSplit, InputPipeline, iterate_batches
from fedcore.engine.loop import to_device
from fedcore.engine.optim import autocast_for
from fedcore.engine.roles import Method, Payload
from fedcore.metrics import DIVERGED
from fedcore.runtime.device import pick_device
from fedcore.train import RunFiles, build_run


@dataclass
class TrainedRun:
    """A run's method with its final states, and each client's train and test data (no augmentation)."""

    method: Method
    train: DeviceSplit
    train_idx: list[Tensor]
    test: DeviceSplit
    test_idx: list[Tensor]
    pipeline: InputPipeline
    server: Payload
    clients: dict[int, Payload]

    @property
    def num_clients(self) -> int:
        """Clients of the partition."""
        return len(self.train_idx)

    def client_model(self, cid: int) -> nn.Module:
        """Client ``cid``'s model as the engine scores it (global tensors, then its own), in eval mode."""
        m = self.method
        model = m.model_for(cid).eval()
        state = self.clients.get(cid) or m.client.init_state(cid)  # a client never sampled keeps its initial state
        m.evaluator.load(model, cid, self.server, state, None)
        return model

    @torch.no_grad()
    def apply(self, fn, split: str, cid: int, batch_size: int = 256) -> tuple[Tensor, Tensor]:
        """(fn(x) stacked as float32, labels) over client ``cid``'s ``split`` ('train' | 'test'), in order."""
        data, idx = (self.train, self.train_idx[cid]) if split == "train" else (self.test, self.test_idx[cid])
        outs, ys = [], []
        for b in iterate_batches(data, idx, batch_size, self.pipeline):
            with autocast_for(b.x):
                outs.append(fn(b.x).float())
            ys.append(b.y)
        if not outs:
            return torch.zeros(0), torch.zeros(0, dtype=torch.long)
        return torch.cat(outs), torch.cat(ys)

    def predictions(self, cid: int, model: nn.Module) -> tuple[Tensor, Tensor]:
        """(the method's own logits, labels) on client ``cid``'s test set: what the run's ``local/acc`` scores."""
        return self.apply(lambda x: self.method.evaluator.predict(model, _batch(x)), "test", cid)


def _batch(x: Tensor):
    """A Batch holding only images (evaluator.predict reads ``x``)."""
    return Batch(x, torch.zeros(len(x), dtype=torch.long, device=x.device), None, {})


def load_trained_run(params: dict[str, Any], identity: dict[str, Any], dataset_path: str | os.PathLike,
                     partition_path: str | os.PathLike, arch: str, weights: str | os.PathLike | None,
                     final_path: str | os.PathLike, device: str = "auto", sha256: str | None = None) -> TrainedRun:
    """Rebuild the run of ``params`` (Resolved.train_params) and load its final states from ``final_path``."""
    where = f"run {identity.get('experiment')}/{identity.get('method')}/seed{identity.get('seed')}"
    if not isinstance(arch, str):
        raise ValueError(f"{where}: the probes rebuild single-backbone runs only, got backbones {arch}")
    final = torch.load(final_path, map_location="cpu", weights_only=False)
    if not isinstance(final, dict) or "server" not in final or "clients" not in final:
        raise ValueError(f"{final_path} is not a final.pt of a training run (keys server and clients expected)")
    got = final.get("identity", {})
    for key in ("experiment", "method", "seed"):
        if key in got and str(got[key]) != str(identity[key]):
            raise ValueError(f"{final_path}: written by {key} {got[key]!r}, expected {identity[key]!r}")
    dev = pick_device(device)
    # built as training builds it (a method that reads artifacts or extra datasets is refused there: none given);
    # images, not cached frozen features, since the probes run the whole model
    run = build_run(params, identity, arch, RunFiles(dataset_path, partition_path, (weights,), (sha256,)), dev,
                    cache_frozen_features=False)
    return TrainedRun(run.method, run.train, run.train_idx, run.eval_sets.source, run.eval_sets.client_indices,
                      run.pipeline, to_device(final["server"], dev),
                      {int(c): to_device(s, dev) for c, s in final["clients"].items()})


def logged_final_accuracy(metrics_path: str | os.PathLike) -> dict[int, float]:
    """Each client's local test accuracy in the run's last evaluated round (its metrics Parquet)."""
    df = pd.read_parquet(metrics_path, columns=["round", "client", "split", "metric", "value"])
    rows = df[(df["split"] == "local") & (df["metric"] == "acc") & (df["client"] >= 0)]
    if rows.empty:
        raise ValueError(f"{metrics_path}: no per-client local accuracy logged")
    last = rows[rows["round"] == rows["round"].max()]
    return {int(c): float(v) for c, v in zip(last["client"], last["value"])}


def run_diverged(metrics_path: str | os.PathLike) -> bool:
    """Whether the run's trained state held NaN or inf at some round (the engine's ``diverged`` rows)."""
    return bool((pd.read_parquet(metrics_path, columns=["metric"])["metric"] == DIVERGED).any())


def check_against_log(origin: dict[int, float], logged: dict[int, float], n_test: dict[int, int], where: str) -> None:
    """Raise when a rebuilt client's accuracy differs from the logged one by more than one test image (a tie that
    autocast rounds the other way may flip one prediction; anything more means the rebuild is not the run)."""
    bad = [(c, a, logged.get(c)) for c, a in origin.items()
           if logged.get(c) is None or abs(a - logged[c]) > 1.0 / max(n_test[c], 1) + 1e-9]
    if bad:
        c, a, b = bad[0]
        raise ValueError(f"{where}: the rebuilt model of client {c} scores {a:.4f} on its test set, the run logged "
                         f"{b} in its final round ({len(bad)} client(s) differ): final.pt and metrics disagree")


def client_iter(run: TrainedRun) -> Iterator[tuple[int, nn.Module]]:
    """(cid, loaded model) for every client, one after another (the model object is reused)."""
    for c in range(run.num_clients):
        yield c, run.client_model(c)


def as_numpy(t: Tensor) -> np.ndarray:
    """A CPU float32 / int64 NumPy copy."""
    return t.detach().cpu().numpy()
