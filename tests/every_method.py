"""Every registered method and variant as the mini configuration runs it, on a few images a client.

One representative run per method name (a variant is its own name): the first experiment that runs it at mini, with
that experiment's dataset, partition (each client cut to its first few images), backbones (random weights) and
per-sample artifacts, planned by fedcore.plan as the training rule plans it. Two rounds, so every strategy
aggregates, every personal state is kept and reloaded, and every evaluator scores. The GPU proxies
(tests/test_gpu_proxies_*.py) run these under the GPU's rules on the CPU.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedcore.artifacts import build_artifact
from fedcore.config import load_config
from fedcore.data.arrays import load_bundle
from fedcore.data.registry import build_dataset
from fedcore.engine import loop
from fedcore.engine.placement import Boundary, off_device, place
from fedcore.partition.file import Partition
from fedcore.partition.make import make_partition
from fedcore.plan import RunPlan, plan_run
from fedcore.train import train_run
from virtual_device import VIRTUAL, OnVirtualDevice

ROOT = Path(__file__).resolve().parents[1]
# one batch a client and epoch; at most MAX_CLIENTS clients unless the experiment names each client's backbone
TRAIN_PER_CLIENT, TEST_PER_CLIENT, MAX_CLIENTS = 4, 2, 3
# the same code in fewer steps: FedTGP's server trains 100 epochs a round, FedGen's 100 Adam steps of its generator,
# FedMD's clients 50 epochs of transfer learning on the whole public set (none here: its steps are the digest's) and a
# digest on its round subset
SMALL_BUDGETS = {"server_epochs": 2, "generator_steps": 2, "pretrain_epochs": 0, "public_subset": 8}


@lru_cache(maxsize=1)
def mini_config():
    """The mini configuration with every output (so every configured run)."""
    return load_config({"scale": "mini", "seeds": [0], "papers": ["sgpt", "fedhpl", "fedotp", "fedpft"],
                        "outputs": "all"}, ROOT)


def _shape(value, epochs: int, key: str = ""):
    """What of a param's value chooses code: its kind and sign, not its size (1 vs 40 prompts: the same code); a
    count of epochs also by how it compares with the local epochs (FedPFT's R_f = 5 of 5 leaves no task phase)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        if "epochs" in key:
            return "0" if value == 0 else ("<E" if value < epochs else ("=E" if value == epochs else ">E"))
        return "0" if value == 0 else (">0" if value > 0 else "<0")
    if isinstance(value, (list, tuple)):
        return ("list", bool(value))
    if isinstance(value, dict):
        return tuple(sorted((k, _shape(v, epochs, k)) for k, v in value.items()))
    return type(value).__name__


def code_path(experiment: str, method: str) -> tuple:
    """A run's method and the shape of its params: two runs with the same key run the same code."""
    cfg = mini_config()
    p = plan_run(cfg, experiment, method, 0)
    params = {**p.method_class.defaults, **p.params["method_params"]}
    return p.method_class.name, _shape(params, int(p.params["federation"]["local_epochs"]))


@lru_cache(maxsize=1)
def representative_runs() -> tuple[tuple[str, str], ...]:
    """(experiment, method) for every method and variant the mini configuration runs, its first experiment; of
    variants that differ from another only in the size of a number (R_f 1 vs 3, 5 vs 40 prompts), the first."""
    cfg, first = mini_config(), {}
    for exp, x in cfg.experiments.items():
        for m in x["methods"]:
            first.setdefault(m, exp)
    out: dict[tuple, tuple[str, str]] = {}
    for m, e in sorted(first.items()):
        out.setdefault(code_path(e, m), (e, m))
    return tuple(sorted(out.values(), key=lambda r: r[1]))


def methods_of(paper: str) -> list[str]:
    """The method names whose representative run belongs to ``paper``."""
    cfg = mini_config()
    return [m for e, m in representative_runs() if cfg.experiments[e]["paper"] == paper]


def _cut(lists: list[np.ndarray] | None, n: int) -> list[np.ndarray] | None:
    return None if lists is None else [a[:n] for a in lists]


@dataclass
class TinyRun:
    """A planned run and the files it reads, each client cut to a few images."""

    plan: RunPlan
    files: dict[str, Path]
    artifacts: dict[str, Path] = field(default_factory=dict)
    extra_datasets: dict[str, Path] = field(default_factory=dict)

    def train(self, out: Path, rounds: int = 2, device: str = "cpu", batched: bool = False):
        """Train it for ``rounds`` rounds (batches of at most 4) on ``device``; the RunResult. ``batched``: a method
        with a choice of client batching (FedPFT's ``client_batching``) trains its clients together."""
        params = copy.deepcopy(self.plan.params)
        fed = params["federation"]
        fed["rounds"], fed["batch_size"] = rounds, min(int(fed["batch_size"]), 4)
        declared = self.plan.method_class.defaults
        params["method_params"].update({k: v for k, v in SMALL_BUDGETS.items() if k in declared})
        if batched and "client_batching" in declared:
            params["method_params"]["client_batching"] = "batched"
        params["evaluation"] = {**params.get("evaluation", {}), "every": 1, "batch_size": 16}
        method = self.plan.identity["method"]
        return train_run(params, self.plan.identity, self.files["dataset"], self.files["partition"], self.plan.archs,
                         None, out / f"{method}.parquet", out / f"{method}.pt", device=device, progress=False,
                         artifacts=self.artifacts, extra_datasets=self.extra_datasets)


def tiny_run(experiment: str, method: str, root: Path) -> TinyRun:
    """The run's plan and its files under ``root`` (datasets and artifacts built once per name there)."""
    cfg = mini_config()
    p = plan_run(cfg, experiment, method, 0)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)

    def dataset(name: str) -> Path:
        path = data / f"{name}.npz"
        if not path.exists():
            build_dataset(name, path)
        return path

    files = {"dataset": dataset(p.dataset)}
    part_path = root / "partitions" / f"{experiment}.npz"
    if not part_path.exists():
        b = load_bundle(files["dataset"])
        full = make_partition(cfg.experiments[experiment]["partition"], 0, b.train.y, b.test.y, b.train.domain,
                              b.test.domain, b.train.coarse, b.test.coarse)
        part_path.parent.mkdir(parents=True, exist_ok=True)
        k = len(full.train) if "client_backbones" in cfg.experiments[experiment] else MAX_CLIENTS
        Partition(_cut(full.train[:k], TRAIN_PER_CLIENT), _cut(full.test[:k], TEST_PER_CLIENT), full.spec, full.seed,
                  _cut(full.train_images and full.train_images[:k], TRAIN_PER_CLIENT),
                  _cut(full.test_images and full.test_images[:k], TEST_PER_CLIENT), full.class_order).save(part_path)
    files["partition"] = part_path
    artifacts = {}
    for name, key in p.artifacts.items():
        path = root / "features" / p.feature_backbone / p.dataset / f"{key}.npz"
        if not path.exists():  # on the experiment's backbone with random weights: only shapes matter here
            path.parent.mkdir(parents=True, exist_ok=True)
            build_artifact(key, files["dataset"], cfg.backbones[p.feature_backbone]["arch"], None, path, device="cpu")
        artifacts[name] = path
    extra = {role: dataset(name) for role, name in p.extra_datasets.items()}
    return TinyRun(p, files, artifacts, extra)


class Recording(Boundary):
    """The engine's boundary, also recording what the server side saw (for a replay on another device)."""

    last: "Recording | None" = None

    def __init__(self, method, device) -> None:
        super().__init__(method, device)
        self.setup_uplinks: list = []
        self.rounds: list[tuple] = []  # (round info, results in arrival order)
        self.num_clients = 0
        Recording.last = self

    def server_init(self, num_clients):
        self.num_clients = num_clients
        return super().server_init(num_clients)

    def server_setup(self, state, uplinks):
        self.setup_uplinks = list(uplinks)
        return super().server_setup(state, uplinks)

    def aggregate(self, info, state, results):
        self.rounds.append((info, list(results)))
        return super().aggregate(info, state, results)


def replay_server_side(rec: Recording) -> None:
    """The run's server side again on a second device (tests/virtual_device.py: ``meta`` holding real data, which
    torch refuses to mix with CPU tensors as it refuses CUDA ones): a copy of the method whose models moved there the
    way a careless caller would (``Module.to``, not ``Method.to``), every client's initial state, the setup exchange,
    and each round's downlinks, arrivals and aggregation, fed the round's uplinks on that device. Raises where a
    tensor left on the CPU meets one there, or where the server state ends off it."""
    shadow = copy.deepcopy(rec.method)
    with OnVirtualDevice():
        for m in shadow.models:
            m.to(VIRTUAL)
        side = Boundary(shadow, VIRTUAL)
        server = side.server_init(rec.num_clients)
        for c in range(rec.num_clients):
            side.client_init(c)
        if rec.setup_uplinks:
            server = side.server_setup(server, [replace(u, uplink=place(u.uplink, VIRTUAL)) for u in rec.setup_uplinks])
        for info, results in rec.rounds:
            _, server = side.select(info, server)
            arrived = []
            for res in results:
                side.downlink(server, res.cid)
                res = replace(res, uplink=place(res.uplink, VIRTUAL))
                server = side.observe(info, server, res)
                arrived.append(res)
            server = side.aggregate(info, server, arrived)
            stray = off_device(server, VIRTUAL)
            if stray:
                raise AssertionError(f"server state off the run's device after round {info.round}: {stray}")


def recorded(monkeypatch) -> type[Recording]:
    """Make the engine use a :class:`Recording` boundary; the class (its ``last`` is the run's)."""
    Recording.last = None
    monkeypatch.setattr(loop, "Boundary", Recording)
    return Recording
