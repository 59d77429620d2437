"""The round loop: sample, update locally, aggregate, evaluate, checkpoint. Methods plug into it."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from fedcore.engine.data import DeviceSplit, InputPipeline, iterate_batches
from fedcore.engine.evaluate import EvalSets, evaluate_round
from fedcore.engine.health import DIVERGED, nonfinite_paths
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.placement import Boundary, check_model_device, place
from fedcore.engine.precision import rules_device
from fedcore.engine.roles import FitResult, Method, Payload, RoundContext, RoundInfo, Together, payload_numbers
from fedcore.engine.sampling import stream_seed
from fedcore.io import atomic_torch_save
from fedcore.metrics import METRIC_COLUMNS, METRIC_DTYPES

log = logging.getLogger(__name__)

IDENTITY_COLUMNS = METRIC_COLUMNS[:6]  # paper, experiment, method, scale, dataset, seed
CHECKPOINT_FORMAT = 2  # per-client state dicts and an opaque server state (format 1: named tensors only)


@dataclass
class RunSpec:
    """Everything about one run that the engine needs besides data, model and method."""

    identity: dict[str, Any]          # paper, experiment, method, scale, dataset, seed
    federation: dict[str, Any]        # rounds, participation, local_epochs, batch_size
    optimizer: dict[str, Any]
    evaluation: dict[str, Any] = field(default_factory=dict)  # global_test, every, batch_size, per_class
    final_window: int = 1             # the last rounds are always evaluated (the report window)
    method_params: dict[str, Any] = field(default_factory=dict)  # the method's (or variant's) params
    # the experiment's base augmentation of every method's training batches (FedPFT §8 A21), applied before the
    # method's own ``Client.augment``, or handed to the client as ``ClientData.base_augment`` (``Client.train_augment``)
    augment: tuple[str, ...] = ()
    # torch.compile mode of the one-pass step of clients trained together (fedcore/engine/onepass.py: "default",
    # "reduce-overhead" = CUDA graphs, "max-autotune"); None (default): eager. Applied on CUDA only, never on the CPU
    compile: str | None = None

    @property
    def seed(self) -> int:
        """The run's seed."""
        return int(self.identity["seed"])

    def fingerprint(self) -> str:
        """Hash of the settings that determine the run's numbers (a checkpoint must match it to resume)."""
        settings = [CHECKPOINT_FORMAT, self.identity, self.federation, self.optimizer, self.evaluation,
                    self.final_window, self.method_params]
        if self.augment:  # only when set: the checkpoints of runs without one keep their fingerprint
            settings.append(list(self.augment))
        if self.compile:  # compiled kernels reassociate floats: a checkpoint of an eager run is not resumed
            settings.append({"compile": self.compile})
        blob = json.dumps(settings, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()

    def evaluated(self, round_idx: int) -> bool:
        """Whether round ``round_idx`` (1-indexed) is evaluated: round 1 (so every per-round curve starts at the
        first round), every ``every``-th round (none when 0), each round of the report window and the
        ``last_rounds``."""
        rounds = int(self.federation["rounds"])
        every = int(self.evaluation.get("every", 1))
        last = max(self.final_window, int(self.evaluation.get("last_rounds", 0)))
        return round_idx == 1 or round_idx > rounds - last or (every > 0 and round_idx % every == 0)


@dataclass
class RunResult:
    """A finished run: its metrics, the server state and every client's state."""

    metrics: pd.DataFrame
    server_state: Payload
    client_states: dict[int, Payload]

    @property
    def global_state(self) -> dict[str, torch.Tensor]:
        """The server's model tensors (empty when the server keeps none)."""
        return self.server_state.get("model", {})

    @property
    def personal_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each client's personal tensors, for the clients that keep any."""
        return {c: s["model"] for c, s in self.client_states.items() if s.get("model")}


class Checkpoint:
    """Per-round resume state, written atomically; ignored (with a warning) if its run settings differ or a
    file the run reads (data, weights, code) changed after it was written."""

    def __init__(self, path: str | Path | None, fingerprint: str, inputs: Sequence[str | Path] = ()) -> None:
        self.path = Path(path) if path else None
        self.fingerprint = fingerprint
        self.inputs = [Path(p) for p in inputs]

    def load(self) -> dict | None:
        """The saved state, or None to start fresh."""
        if self.path is None or not self.path.exists():
            return None
        # Snakemake's own rule: an input newer than a result means the result is out of date. A finished
        # run keeps its checkpoint, so without this an edited method would be "resumed" and not retrained.
        written = self.path.stat().st_mtime_ns
        newer = [str(p) for p in self.inputs if p.stat().st_mtime_ns > written]
        if newer:
            log.warning("checkpoint %s is older than %s, which the run reads; starting from round 1",
                        self.path, ", ".join(newer))
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
        atomic_torch_save({**state, "fingerprint": self.fingerprint}, self.path)


def to_device(state: dict, device: torch.device) -> dict:
    """Move a (possibly nested) state of tensors to ``device``."""
    return place(state, device)


def run_federated(method: Method, train: DeviceSplit, test: DeviceSplit, client_train: list[torch.Tensor],
                  eval_sets: EvalSets, pipeline: InputPipeline, spec: RunSpec,
                  checkpoint_path: str | Path | None = None, stop_after_round: int | None = None,
                  progress: bool = True, checkpoint_inputs: Sequence[str | Path] = (),
                  client_weights: Sequence[float] | None = None) -> RunResult | None:
    """Run (or resume) a federated training; None if stopped early by ``stop_after_round``.

    A checkpoint older than any of ``checkpoint_inputs`` (the files the run reads) is not resumed.
    ``client_weights`` (one per client) replace the clients' sample counts as their weights in the server's
    averages (``FitResult.num_samples``); None keeps the counts.
    """
    fed = spec.federation
    rounds, num_clients = int(fed["rounds"]), len(client_train)
    device = train.x.device
    settings = TrainSettings(int(fed["local_epochs"]), int(fed["batch_size"]), dict(spec.optimizer),
                             compile=spec.compile if device.type == "cuda" else None)
    eval_bs = int(spec.evaluation.get("batch_size", 4 * settings.batch_size))
    check_model_device(method.models, device)
    roles = Boundary(method, device)  # every state and payload a role hands over comes out on the run's device
    ckpt = Checkpoint(checkpoint_path, spec.fingerprint(), checkpoint_inputs)
    client, evaluator = method.client, method.evaluator
    if client_weights is not None and len(client_weights) != num_clients:
        raise ValueError(f"{len(client_weights)} client weights for {num_clients} clients")

    # a client whose model trains BatchNorm skips a last batch of one sample (its batch statistics are undefined
    # and torch raises; PFLlib's loaders drop_last); frozen or BatchNorm-free models see every sample
    single_ok = [not trains_batchnorm(method.model_for(c)) for c in range(num_clients)]
    # ``federation.drop_last`` (FedOTP's code: Dassl's train loader drops the last incomplete batch of a client that
    # holds at least one whole batch); otherwise only the BatchNorm rule above
    drop_last = bool(fed.get("drop_last", False))
    least = [settings.batch_size if drop_last and len(client_train[c]) >= settings.batch_size
             else 1 if single_ok[c] else 2 for c in range(num_clients)]

    augment, handed = client.train_augment(tuple(spec.augment))

    def data_of(c: int, r: int, stream: int = 0) -> ClientData:
        return _client_data(c, r, spec.seed, client_train[c], train, pipeline, settings, augment, stream,
                            min_batch=least[c], base_augment=handed)

    state = ckpt.load()
    if state is None:
        server = roles.server_init(num_clients)
        ups = [(c, roles.client_setup(c, data_of(c, 0))) for c in range(num_clients)]
        ups = [FitResult(c, len(client_train[c]) if client_weights is None else client_weights[c], up, {})
               for c, up in ups if up is not None]
        if ups:
            server = roles.server_setup(server, ups)
        state = {"round": 0, "server": server, "clients": {}, "rows": []}
    else:
        state = place(state, device)
        log.info("resuming from round %d of %d", state["round"], rounds)
    clients: dict[int, Payload] = state["clients"]

    def client_state(c: int) -> Payload:
        return clients[c] if c in clients else roles.client_init(c)

    why_not = _why_not_together(method)
    log.info("clients train %s", f"together: {_how_together(method)}" if why_not is None else f"one by one: {why_not}")
    bar = tqdm(range(state["round"] + 1, rounds + 1), disable=not progress, desc=spec.identity["method"],
               initial=state["round"], total=rounds)
    for r in bar:
        info = RoundInfo(r, num_clients, float(fed["participation"]), spec.seed)
        selected, state["server"] = roles.select(info, state["server"])
        datas = [data_of(c, r) for c in selected]
        if why_not is None and len(selected) > 1:
            outcomes = _fit_groups(roles, state["server"], [client_state(c) for c in selected], datas, settings,
                                   spec.seed, r)
        else:
            outcomes = (_fit_one(roles, state["server"], client_state(d.cid), d, settings, spec.seed, r)
                        for d in datas)
        results: list[FitResult] = []
        for new_state, res in outcomes:  # one by one: the generator configures the next client after this
            if client_weights is not None:
                res = replace(res, num_samples=client_weights[res.cid])
            clients[res.cid] = new_state
            results.append(res)
            state["server"] = roles.observe(info, state["server"], res)
            state["rows"].append((r, res.cid, "train", "loss", float(res.stats.get("loss", float("nan")))))
        state["rows"].extend(_upload_rows(r, results))
        state["server"] = roles.aggregate(info, state["server"], results)
        diverged = nonfinite_paths({"server": state["server"], **{f"client{res.cid}": clients[res.cid]
                                                                   for res in results}})
        if diverged:  # trained on, as the papers' code would; the report marks every number of this run
            log.warning("round %d: %d trained tensor(s) hold NaN or inf (%s); the run goes on, its numbers are "
                        "marked as diverged", r, len(diverged), ", ".join(diverged[:4]))
            state["rows"].append((r, -1, "train", DIVERGED, float(len(diverged))))
        losses = [float(res.stats.get("loss", float("nan"))) for res in results]
        state["rows"].append((r, -1, "train", "loss", float(sum(losses) / len(losses))))
        state["rows"].extend((r, -1, "train", name, float(v))
                             for name, v in method.strategy.train_metrics(info, results).items())
        model = method.models[0].eval()  # evaluation: BatchNorm uses its statistics, dropout is off
        evaluator.load(model, None, state["server"], None, None)
        ctx = RoundContext(r, spec.evaluated(r), train, client_train, eval_sets, pipeline, eval_bs)
        state["rows"].extend((r, *row) for row in evaluator.round_rows(ctx, model, state["server"]))
        if spec.evaluated(r):
            def load(c: int | None, r: int = r) -> torch.nn.Module:
                if c is None:
                    evaluator.load(model, None, state["server"], None, None)
                    return model
                m = method.model_for(c).eval()
                torch.manual_seed(stream_seed(spec.seed, r, c, 3))  # any randomness of an eval-time adaptation
                evaluator.load(m, c, state["server"], client_state(c), data_of(c, r, stream=2))
                return m
            per_class = bool(spec.evaluation.get("per_class", False))
            untrained = frozenset(c for c in range(num_clients) if c not in clients)
            exclude = spec.evaluation.get("untrained_clients", "include") == "exclude"
            for c, split, metric, value in evaluate_round(method, eval_sets, pipeline, eval_bs, load, per_class,
                                                          untrained, exclude):
                state["rows"].append((r, c, split, metric, value))
                if c == -1 and split == "global":
                    bar.set_postfix(global_acc=f"{value:.3f}")
        state["round"] = r
        ckpt.save(state)
        if stop_after_round is not None and r >= stop_after_round and r < rounds:
            return None
    return RunResult(metrics_frame(state["rows"], spec.identity), state["server"], clients)


def _upload_rows(r: int, results: list[FitResult]) -> list[tuple[int, int, str, str, float]]:
    """The numbers each client sent this round (``upload_numbers``), their total and mean over the round's
    clients: the communication cost of any method (FedHPL Tables 9, 10), counted from the uplinks themselves."""
    sent = [(res.cid, float(payload_numbers(res.uplink))) for res in results]
    rows = [(r, c, "train", "upload_numbers", n) for c, n in sent]
    if sent:
        total = sum(n for _, n in sent)
        rows += [(r, -1, "train", "upload_numbers_total", total), (r, -1, "train", "upload_numbers_mean",
                                                                    total / len(sent))]
    return rows


def _client_data(c: int, r: int, seed: int, idx: torch.Tensor, train: DeviceSplit, pipeline: InputPipeline,
                 settings: TrainSettings, augment: tuple[str, ...] = (), stream: int = 0,
                 min_batch: int = 1, base_augment: tuple[str, ...] = ()) -> ClientData:
    """Client c's data in round r, its batch order (and ``augment``) drawn from a generator keyed by (seed, r, c,
    stream); a last batch smaller than ``min_batch`` is skipped; ``base_augment``: names the client applies itself."""
    gen = torch.Generator(device="cpu").manual_seed(stream_seed(seed, r, c, stream))
    return ClientData(c, len(idx), lambda: iterate_batches(train, idx, settings.batch_size, pipeline, gen, augment,
                                                           min_batch), gen, settings,
                      lambda x, name: pipeline.augment(x, name, gen), base_augment, pipeline,
                      lambda: iterate_batches(train, idx, settings.batch_size, pipeline))


def trains_batchnorm(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a BatchNorm layer with a trainable parameter (it then normalises by batch statistics)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and any(p.requires_grad for p in m.parameters())
               for m in model.modules())


def _fit_one(roles: Boundary, server: Payload, state: Payload, data: ClientData, settings: TrainSettings,
             seed: int, r: int) -> tuple[Payload, FitResult]:
    """One client's round on its own."""
    torch.manual_seed(stream_seed(seed, r, data.cid, 1))  # any method-internal randomness
    roles.method.model_for(data.cid).train()
    return roles.fit(data.cid, state, roles.downlink(server, data.cid), data, settings)


def _plan(method: Method, model: torch.nn.Module) -> Together:
    """The client's together path for ``model`` on the run's device (its rules' device type)."""
    return method.client.together(rules_device(_a_tensor_of(model)), model)


def _why_not_together(method: Method) -> str | None:
    """Why no round's clients can train together (None: those that share a model can, where it offers a path)."""
    plans = [_plan(method, m) for m in method.models]
    return None if any(p.fit is not None for p in plans) else plans[0].why_not


def _how_together(method: Method) -> str:
    """How the clients of each model train together (or why not), for the run log."""
    lines = []
    for m in method.models:
        p = _plan(method, m)
        line = p.how if p.fit is not None else f"one by one ({p.why_not})"
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def _fit_groups(roles: Boundary, server: Payload, states: list[Payload], datas: list[ClientData],
                settings: TrainSettings, seed: int, r: int) -> list[tuple[Payload, FitResult]]:
    """The round's clients, in its order: those that share a model trained together where the client offers a path
    for it (``_fit_together``), the others one by one; every client's downlink from the round's server state. On the
    CPU a round whose clients train several models groups them only where the path is exact (as before the one pass,
    vmapped groups of such a round train one by one: their numbers would move by float reassociation)."""
    method = roles.method
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(datas):
        groups.setdefault(method.backbone_index(d.cid), []).append(i)
    out: list[tuple[Payload, FitResult] | None] = [None] * len(datas)
    for b, idx in groups.items():
        plan = _plan(method, method.models[b])
        cpu = rules_device(_a_tensor_of(method.models[b])) == "cpu"
        if len(idx) > 1 and plan.fit is not None and (len(groups) == 1 or plan.exact or not cpu):
            done = _fit_together(roles, server, [states[i] for i in idx], [datas[i] for i in idx], settings)
        else:
            done = [_fit_one(roles, server, states[i], datas[i], settings, seed, r) for i in idx]
        for i, o in zip(idx, done, strict=True):
            out[i] = o
    return out  # type: ignore[return-value]


def _fit_together(roles: Boundary, server: Payload, states: list[Payload], datas: list[ClientData],
                  settings: TrainSettings) -> list[tuple[Payload, FitResult]]:
    """Clients of one model trained together by the path their client offers for it (``Client.together``)."""
    model = roles.method.model_for(datas[0].cid).train()
    return roles.fit_together(_plan(roles.method, model).fit, states, [roles.downlink(server, d.cid) for d in datas],
                              datas, settings)


def _a_tensor_of(model: torch.nn.Module) -> torch.Tensor:
    """A tensor on the model's device (autocast_for decides by it)."""
    return next(iter(model.parameters()))


def metrics_frame(rows: list[tuple], identity: dict[str, Any]) -> pd.DataFrame:
    """Long-form metrics with the run identity on every row, in the schema's column order and dtypes."""
    df = pd.DataFrame(rows, columns=["round", "client", "split", "metric", "value"])
    for k in reversed(IDENTITY_COLUMNS):
        df.insert(0, k, identity[k])
    df = df.astype({c: (str if t == "str" else t) for c, t in METRIC_DTYPES.items()})
    return df[METRIC_COLUMNS]
