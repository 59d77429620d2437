"""The round loop: sample, update locally, aggregate, evaluate, checkpoint. Methods plug into it."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from fedcore.engine.batched import can_batch, train_together
from fedcore.engine.data import DeviceSplit, InputPipeline, iterate_batches
from fedcore.engine.evaluate import EvalSets, evaluate_round
from fedcore.engine.sampling import sample_clients, stream_seed
from fedcore.io import atomic_path
from fedcore.methods.base import ClientData, Method, RoundContext, TrainSettings
from fedcore.report.aggregate import METRIC_COLUMNS, METRIC_DTYPES

log = logging.getLogger(__name__)

IDENTITY_COLUMNS = METRIC_COLUMNS[:6]  # paper, experiment, method, scale, dataset, seed


@dataclass
class RunSpec:
    """Everything about one run that the engine needs besides data, model and method."""

    identity: dict[str, Any]          # paper, experiment, method, scale, dataset, seed
    federation: dict[str, Any]        # rounds, participation, local_epochs, batch_size
    optimizer: dict[str, Any]
    evaluation: dict[str, Any] = field(default_factory=dict)  # global_test, every, batch_size
    final_window: int = 1             # the last rounds are always evaluated (the report window)
    method_params: dict[str, Any] = field(default_factory=dict)  # the method's (or variant's) params

    @property
    def seed(self) -> int:
        """The run's seed."""
        return int(self.identity["seed"])

    def fingerprint(self) -> str:
        """Hash of the settings that determine the run's numbers (a checkpoint must match it to resume)."""
        blob = json.dumps([self.identity, self.federation, self.optimizer, self.evaluation, self.final_window,
                           self.method_params], sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()

    def evaluated(self, round_idx: int) -> bool:
        """Whether round ``round_idx`` (1-indexed) is evaluated."""
        rounds = int(self.federation["rounds"])
        every = int(self.evaluation.get("every", 1))
        return round_idx > rounds - self.final_window or round_idx % every == 0


@dataclass
class RunResult:
    """A finished run: its metrics and final model state."""

    metrics: pd.DataFrame
    global_state: dict[str, torch.Tensor]
    personal_states: dict[int, dict[str, torch.Tensor]]
    server_state: dict[str, Any]


class Checkpoint:
    """Per-round resume state, written atomically; ignored (with a warning) if its run settings differ."""

    def __init__(self, path: str | Path | None, fingerprint: str) -> None:
        self.path = Path(path) if path else None
        self.fingerprint = fingerprint

    def load(self) -> dict | None:
        """The saved state, or None to start fresh."""
        if self.path is None or not self.path.exists():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
            raise RuntimeError(f"checkpoint {self.path} cannot be read ({type(e).__name__}: {e}); delete it to "
                               "restart this run from round 1") from e
        if not isinstance(state, dict) or state.get("fingerprint") != self.fingerprint:
            log.warning("checkpoint %s was written for other settings; starting from round 1", self.path)
            return None
        return state

    def save(self, state: dict) -> None:
        """Write the state atomically (a kill mid-write leaves the previous checkpoint intact)."""
        if self.path is None:
            return
        with atomic_path(self.path, suffix=".pt") as tmp:
            torch.save({**state, "fingerprint": self.fingerprint}, tmp)


def _to_device(state: dict, device: torch.device) -> dict:
    """Move a (possibly nested) state of tensors to ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    return state


def run_federated(method: Method, train: DeviceSplit, test: DeviceSplit, client_train: list[torch.Tensor],
                  eval_sets: EvalSets, pipeline: InputPipeline, spec: RunSpec,
                  checkpoint_path: str | Path | None = None, stop_after_round: int | None = None,
                  progress: bool = True) -> RunResult | None:
    """Run (or resume) a federated training; None if stopped early by ``stop_after_round``."""
    fed = spec.federation
    rounds, num_clients = int(fed["rounds"]), len(client_train)
    settings = TrainSettings(int(fed["local_epochs"]), int(fed["batch_size"]), dict(spec.optimizer))
    eval_bs = int(spec.evaluation.get("batch_size", 4 * settings.batch_size))
    device = train.x.device
    ckpt = Checkpoint(checkpoint_path, spec.fingerprint())

    shared, personal = method.shared_names(), method.personal_names()
    init_personal = method.get_state(personal)
    state = ckpt.load()
    if state is None:
        state = {"round": 0, "global": method.get_state(shared), "personal": {},
                 "server": method.init_server_state(), "rows": []}
        method.server_state = state["server"]
        method.setup([_client_data(c, 0, spec.seed, client_train[c], train, pipeline, settings)
                      for c in range(num_clients)], state["server"])
    else:
        state = _to_device(state, device)
        log.info("resuming from round %d of %d", state["round"], rounds)
    method.server_state = state["server"]

    bar = tqdm(range(state["round"] + 1, rounds + 1), disable=not progress, desc=spec.identity["method"],
               initial=state["round"], total=rounds)
    for r in bar:
        selected = list(range(num_clients)) if method.train_all_clients else \
            sample_clients(num_clients, float(fed["participation"]), spec.seed, r)
        uploads, weights, losses = [], [], []
        datas = [_client_data(c, r, spec.seed, client_train[c], train, pipeline, settings) for c in selected]
        if can_batch(method, settings, len(selected)):
            starts = [_start_state(method, state, c, init_personal) for c in selected]
            outcomes = train_together(method, starts, datas, settings)
        else:  # lazily, so only one client's start state exists at a time (a whole ViT for FedAvg)
            outcomes = (_train_one(method, _start_state(method, state, d.cid, init_personal), d, settings,
                                   spec.seed, r) for d in datas)
        for data, (final, stats) in zip(datas, outcomes, strict=True):
            method.set_state(final)
            if personal:
                state["personal"][data.cid] = method.get_state(personal)
            if shared:
                uploads.append(method.upload(data, stats))
                weights.append(float(data.num_samples))
            losses.append(stats.get("loss", float("nan")))
            state["rows"].append((r, data.cid, "train", "loss", float(losses[-1])))
        if uploads:
            state["global"] = method.aggregate(state["global"], uploads, weights, state["server"])
        state["rows"].append((r, -1, "train", "loss", float(sum(losses) / len(losses))))
        method.set_state(state["global"])
        ctx = RoundContext(r, spec.evaluated(r), train, client_train, eval_sets, pipeline, eval_bs)
        state["rows"].extend((r, *row) for row in method.round_rows(ctx))
        if spec.evaluated(r):
            def client_state(c: int, r: int = r) -> dict[str, torch.Tensor]:
                data = _client_data(c, r, spec.seed, client_train[c], train, pipeline, settings, stream=2)
                torch.manual_seed(stream_seed(spec.seed, r, c, 3))  # any randomness of an eval-time adaptation
                return method.eval_state(c, state["global"], state["personal"].get(c, init_personal),
                                         state["server"], data)
            for client, split, metric, value in evaluate_round(method, eval_sets, pipeline, eval_bs,
                                                               state["global"], client_state):
                state["rows"].append((r, client, split, metric, value))
                if client == -1 and split == "global":
                    bar.set_postfix(global_acc=f"{value:.3f}")
        state["round"] = r
        ckpt.save(state)
        if stop_after_round is not None and r >= stop_after_round and r < rounds:
            return None
    method.set_state(state["global"])
    return RunResult(metrics_frame(state["rows"], spec.identity), state["global"], state["personal"],
                     state["server"])


def _client_data(c: int, r: int, seed: int, idx: torch.Tensor, train: DeviceSplit, pipeline: InputPipeline,
                 settings: TrainSettings, stream: int = 0) -> ClientData:
    """Client c's data in round r, its batch order drawn from a generator keyed by (seed, r, c, stream)."""
    gen = torch.Generator(device="cpu").manual_seed(stream_seed(seed, r, c, stream))
    return ClientData(c, len(idx), lambda: iterate_batches(train, idx, settings.batch_size, pipeline, gen), gen)


def _start_state(method: Method, state: dict, c: int, init_personal: dict) -> dict[str, torch.Tensor]:
    """Client c's trainable tensors at the start of its update (default: the global ones plus its personal ones)."""
    method.set_state(state["global"])
    method.set_state(method.start_state(c, state["global"], state["personal"].get(c, init_personal), state["server"]))
    return method.get_state(method.trainable_names())


def _train_one(method: Method, start: dict[str, torch.Tensor], data: ClientData, settings: TrainSettings,
               seed: int, r: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One client's local update on its own; returns its final trainable tensors and stats."""
    method.set_state(start)
    torch.manual_seed(stream_seed(seed, r, data.cid, 1))  # any method-internal randomness
    stats = method.local_update(data, settings)
    return method.get_state(method.trainable_names()), stats


def metrics_frame(rows: list[tuple], identity: dict[str, Any]) -> pd.DataFrame:
    """Long-form metrics with the run identity on every row, in the schema's column order and dtypes."""
    df = pd.DataFrame(rows, columns=["round", "client", "split", "metric", "value"])
    for k in reversed(IDENTITY_COLUMNS):
        df.insert(0, k, identity[k])
    df = df.astype({c: (str if t == "str" else t) for c, t in METRIC_DTYPES.items()})
    return df[METRIC_COLUMNS]
