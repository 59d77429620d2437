"""The three roles of a federated method, with FedAvg defaults; a method file overrides only what differs.

Modelled on Flower: the server ``Strategy`` and the ``Client`` never share an object. They exchange opaque
payloads: a downlink (``Strategy.configure``) and an uplink (``Client.fit``), each a dict that may hold
named tensors, per-class logits, counts, anything ``torch.save`` can store. The ``Evaluator`` decides which
model scores each client. The engine owns everything else: sampling through the strategy, the round loop,
each client's complete state and the server state (both checkpointed every round), evaluation, seeding.

* ``Strategy``: ``init_state`` (server state, default ``{"model": <shared tensors>}``), ``setup`` (a once-per-
  run exchange before round 1), ``select`` (the round's clients), ``configure`` (one client's downlink),
  ``observe`` (one client's result, as it arrives), ``aggregate`` (uplinks -> next server state; default:
  sample-weighted average of ``uplink["model"]``), ``train_metrics`` (per-round training metrics from the round's
  results besides the mean loss, as Flower's fit-metrics aggregation; default none).
* ``Client``: ``init_state`` (what a client keeps across rounds: its personal tensors, and its optimiser
  state when ``keep_optimizer``), ``fit`` = ``start`` (load downlink, then own state) -> ``train`` (epochs of
  ``loss``) -> ``finish`` (new state + ``upload``). ``shared_keys``/``personal_keys`` split the model's
  state; ``augment`` names on-device training augmentations, ``train_augment`` which of the experiment's base
  augmentation the engine applies and which the client applies itself. One optional capability, ``together``:
  whether and how a round's clients that share a model train together (a :class:`Together`: the callable that
  trains them, or why they cannot), asked per device type and model; fedcore/engine/batching.py builds the
  generic paths (one pass through the frozen backbone, vmap) from what a client declares.
* ``Evaluator``: ``load`` (the model that scores client ``cid``, or the global model), ``predict``,
  ``round_rows`` (extra per-round metrics for a paper's figures), ``one_pass`` (optional: the clients' own models
  score a batch together).

A ``Method`` is the recipe: its params, the trainable model around a frozen backbone (``build``), the
per-sample artifacts it needs (``artifacts``), the other dataset bundles it reads (``extra_datasets``: e.g.
FedMD's public data, handed over by ``attach_dataset``), and which role classes it uses (``client_role``,
``strategy_role``, ``evaluator_role``). A role reads the run's params as ``self.params``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Constraint, violations
from fedcore.engine.aggregation import weighted_average
from fedcore.engine.data import Batch, check_augment
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for, run_epochs
from fedcore.engine.sampling import sample_clients

if TYPE_CHECKING:
    from fedcore.engine.batching import OnePassEval
    from fedcore.engine.data import DeviceSplit, InputPipeline
    from fedcore.engine.evaluate import EvalSets

Payload = dict[str, Any]
State = dict[str, Tensor]


@dataclass
class FitResult:
    """What one client's round produced: its uplink and training stats, and who it is."""

    cid: int
    num_samples: int
    uplink: Payload
    stats: dict[str, float]


def mean_stats(results: Sequence[FitResult]) -> dict[str, float]:
    """Each training stat besides ``loss`` as its mean over the results that report it (NaN-free), by name: e.g.
    per-phase losses for a paper's loss curves (a strategy's ``train_metrics``)."""
    out = {}
    for name in sorted({k for res in results for k in res.stats} - {"loss"}):
        values = [float(res.stats[name]) for res in results if name in res.stats]
        values = [v for v in values if v == v]
        out[name] = sum(values) / len(values) if values else float("nan")
    return out


#: trains a round's clients together: their states, downlinks, data and settings -> each client's (new state,
#: result) in the same order, as ``Client.fit`` gives them one by one
FitTogether = Callable[[list["Payload"], list["Payload"], list[ClientData], TrainSettings],
                       list[tuple["Payload", FitResult]]]


@dataclass(frozen=True)
class Together:
    """A client's answer to ``Client.together``: how a round's clients of one model train together (``fit``, and
    ``how`` for the run log), or why they train one by one (``why_not``). Every client trained together gets its
    downlink from the same server state, so a strategy whose ``observe`` changes what later clients receive
    must not offer one."""

    fit: FitTogether | None = None
    why_not: str = ""
    how: str = ""
    #: the path gives every client its one-by-one numbers bit for bit on this device (the one pass on the CPU)
    exact: bool = False

    @classmethod
    def no(cls, why: str) -> "Together":
        """One by one, because ``why``."""
        return cls(None, why)


@dataclass
class ExtraData:
    """A dataset bundle a method reads besides the run's own (``Method.extra_datasets``): its train split on the
    run's device, its class count and the run's input pipeline (batches come from ``iterate_batches``)."""

    split: "DeviceSplit"
    num_classes: int
    pipeline: "InputPipeline"


@dataclass
class RoundInfo:
    """The round as the strategy sees it."""

    round: int
    num_clients: int
    participation: float
    seed: int


@dataclass
class RoundContext:
    """What ``Evaluator.round_rows`` may read: the round, the data and whether the round is evaluated."""

    round: int
    evaluated: bool
    train: "DeviceSplit"
    client_train: list[Tensor]   # each client's train indices into ``train``
    eval_sets: "EvalSets"
    pipeline: "InputPipeline"
    batch_size: int              # evaluation batch size


# ---- module state ---------------------------------------------------------------------------------
def payload_numbers(payload: Any) -> int:
    """How many numbers a payload carries: every tensor's elements, one per Python number, nested dicts and
    lists counted through (strings and None carry none). What a client sends, whatever the method."""
    if isinstance(payload, Tensor):
        return payload.numel()
    if payload is None or isinstance(payload, str):
        return 0
    if isinstance(payload, (int, float)):
        return 1
    if isinstance(payload, dict):
        return sum(payload_numbers(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_numbers(v) for v in payload)
    raise TypeError(f"a payload holds a {type(payload).__name__}; expected tensors, numbers, dicts or lists")


def state_keys(model: nn.Module) -> list[str]:
    """Everything a client's copy of ``model`` holds: its trainable parameters, then its persistent buffers
    (e.g. a trained CNN's BatchNorm statistics) except those inside a wholly frozen module (a frozen backbone)."""
    keys = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [name for name, mod in model.named_modules()
              if any(True for _ in mod.parameters()) and not any(p.requires_grad for p in mod.parameters())]
    for name, _ in model.named_buffers():
        owner = name.rpartition(".")[0]
        if not any(owner == f or owner.startswith(f + ".") or f == "" for f in frozen):
            keys.append(name)
    return keys


def _tensors(model: nn.Module) -> dict[str, Tensor]:
    """Parameters and buffers by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def module_state(model: nn.Module, keys: Sequence[str]) -> State:
    """Detached copies of the named parameters and buffers."""
    t = _tensors(model)
    return {k: t[k].detach().clone() for k in keys}


@torch.no_grad()
def load_state(model: nn.Module, state: State) -> None:
    """Copy tensors into the model's parameters and buffers in place."""
    t = _tensors(model)
    for k, v in state.items():
        t[k].copy_(v)


# ---- roles ----------------------------------------------------------------------------------------
class Role:
    """A role holds a reference to its method's recipe (params, models), never to another role's state."""

    def __init__(self, method: "Method") -> None:
        self.method = method

    @property
    def params(self) -> dict[str, Any]:
        """The method's parameters."""
        return self.method.params


class Client(Role):
    """Client update, FedAvg default: load the downlink, train every parameter with CE, upload the whole state."""

    #: keep the optimiser's state across rounds (part of the client's state and of every checkpoint)
    keep_optimizer: ClassVar[bool] = False
    #: on-device augmentations of training batches (fedcore.engine.data.AUGMENTATIONS), seeded per client/round
    augment: ClassVar[tuple[str, ...]] = ()

    def train_augment(self, base: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(what the engine applies to every training batch, in order; what it hands over as ``ClientData.
        base_augment`` for the client to apply where it wants) given the experiment's base augmentation ``base``.
        Default: the engine applies ``base``, then the client's own ``augment``."""
        return tuple(base) + tuple(self.augment), ()

    def together(self, device: str, model: nn.Module) -> Together:
        """Whether and how a round's clients that train ``model`` train together on a device of type ``device``
        (the rules' device: fedcore.engine.precision.rules_device). Default: one by one."""
        return Together.no(f"{type(self).__name__} declares no way to train a round's clients together")

    def shared_keys(self, keys: list[str]) -> list[str]:
        """State keys sent to the server (default: all)."""
        return list(keys)

    def personal_keys(self, keys: list[str]) -> list[str]:
        """State keys the client keeps across rounds (default: none)."""
        return []

    def init_state(self, cid: int) -> Payload:
        """A client's state before it ever trains: its personal tensors as the model was built."""
        return {"model": self.method.initial_state(cid, self.personal_keys(self.method.keys(cid)))}

    def setup(self, cid: int, data: ClientData) -> Payload | None:
        """A once-per-run uplink before round 1 (FedMix's mean data); None: nothing to send."""
        return None

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """One round of the client: start, train, finish."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        stats, opt_state = self.train(model, cid, state, downlink, data, settings)
        return self.finish(model, cid, state, data, stats, opt_state)

    def start(self, model: nn.Module, cid: int, state: Payload, downlink: Payload) -> None:
        """Load the downlink's tensors, then the client's own ones."""
        load_state(model, downlink.get("model", {}))
        load_state(model, state.get("model", {}))

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], dict | None]:
        """``local_epochs`` epochs of ``loss`` over every trainable tensor; returns stats and optimiser state. A model
        with no trainable tensor (zero-shot CLIP) has nothing to train: no pass over the data, loss NaN."""
        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        if not params:
            return {"loss": float("nan")}, None
        opt_state = state.get("optimizer") if self.keep_optimizer else None
        return run_epochs(params, data, settings, settings.local_epochs, lambda b: self.loss(model, b), opt_state)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Training loss of one batch (cross-entropy)."""
        return F.cross_entropy(model(batch.x), batch.y)

    def finish(self, model: nn.Module, cid: int, state: Payload, data: ClientData, stats: dict[str, float],
               opt_state: dict | None) -> tuple[Payload, FitResult]:
        """The client's new state and its result (uplink and stats)."""
        new_state = {**state, "model": module_state(model, self.personal_keys(self.method.keys(cid)))}
        if self.keep_optimizer:
            new_state["optimizer"] = opt_state
        return new_state, FitResult(cid, data.num_samples, self.upload(model, cid, data, stats), stats)

    def upload(self, model: nn.Module, cid: int, data: ClientData, stats: dict[str, float]) -> Payload:
        """The uplink (default: the shared tensors)."""
        return {"model": module_state(model, self.shared_keys(self.method.keys(cid)))}


class Strategy(Role):
    """Server strategy, FedAvg: sample by participation, send the global tensors, average uplinks by sample count."""

    def init_state(self, num_clients: int) -> Payload:
        """Server state before round 1 (default: the initial shared tensors as the global model)."""
        keys = self.method.client.shared_keys(self.method.keys(0))
        return {"model": self.method.initial_state(0, keys)}

    def setup(self, state: Payload, uplinks: list[FitResult]) -> None:
        """Once per run, before round 1, with every client's ``Client.setup`` uplink (default: nothing)."""

    def select(self, info: RoundInfo, state: Payload) -> list[int]:
        """The round's clients (sorted)."""
        return sample_clients(info.num_clients, info.participation, info.seed, info.round)

    def configure(self, state: Payload, cid: int) -> Payload:
        """Client ``cid``'s downlink."""
        return {"model": state["model"]}

    def observe(self, info: RoundInfo, state: Payload, result: FitResult) -> Payload:
        """The server state after one client's result arrives, before the next client of the round is configured
        (clients trained one by one; clients trained together all start from the same state). Default: unchanged;
        SGPT's code-timed selection counter adds each client's counts here."""
        return state

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """The next server state from the round's results (default: sample-weighted average of the models)."""
        if not results or not state.get("model"):
            return state
        new = weighted_average([r.uplink["model"] for r in results], [float(r.num_samples) for r in results],
                               names=list(state["model"]))
        return {**state, "model": new}

    def train_metrics(self, info: RoundInfo, results: list[FitResult]) -> dict[str, float]:
        """Training metrics of the round besides the mean loss, logged for client -1 (default: none; ``mean_stats``
        gives every stat's mean over the clients)."""
        return {}


class Evaluator(Role):
    """Scores one global model for everyone (default) or each client's own model (``personalized``)."""

    personalized: ClassVar[bool] = False

    def load(self, model: nn.Module, cid: int | None, server: Payload, client_state: Payload | None,
             data: ClientData | None) -> None:
        """Load the model that scores client ``cid`` (None: the global model; ``data``: its train data)."""
        load_state(model, server.get("model", {}))
        if cid is not None:
            self.method.client.start(model, cid, client_state or {}, self.method.strategy.configure(server, cid))

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> Tensor:
        """Logits at evaluation time."""
        with autocast_for(batch.x):
            return model(batch.x).float()

    def one_pass(self, model: nn.Module) -> "OnePassEval | None":
        """How the clients' own models (``personalized``) score a batch together, each client's tensors stacked
        (fedcore/engine/batching.py), or None (default): one client's model at a time."""
        return None

    def round_rows(self, ctx: RoundContext, model: nn.Module, server: Payload) -> list[tuple[int, str, str, float]]:
        """Extra (client, split, metric, value) rows for this round, global model loaded (default: none)."""
        return []


class Method:
    """A federated method's recipe: params, the trainable model around each frozen backbone, and its roles."""

    name: ClassVar[str] = "base"
    #: default method parameters; the experiment's ``method_params[name]`` overrides them
    defaults: ClassVar[dict[str, Any]] = {}
    #: one constraint per param (fedcore.constraints: ranges, choices, block indices, limits that depend on the
    #: run), checked for every run when the config loads, before any job; its context-free part again at build
    param_rules: ClassVar[dict[str, Constraint]] = {}
    #: the role classes this method uses (a method file sets only those it overrides, e.g. ``strategy_role =
    #: MyServer`` with ``class MyServer(Strategy)``); each is built once per run with the recipe as ``self.method``
    client_role: ClassVar[type[Client]] = Client
    strategy_role: ClassVar[type[Strategy]] = Strategy
    evaluator_role: ClassVar[type[Evaluator]] = Evaluator

    @classmethod
    def with_defaults(cls, params: dict | None) -> dict:
        """The method's full params: its defaults, then ``params`` (a run's method_params) over them."""
        return {**cls.defaults, **(params or {})}

    def __init__(self, backbones: Any, num_classes: int, params: dict | None = None,
                 client_backbones: Sequence[int] | None = None, class_names: Sequence[str] | None = None) -> None:
        """``backbones``: one frozen backbone adapter, or a list of them with ``client_backbones[cid]`` indexing it;
        ``class_names``: how a text prompt names each class (CLIP methods read them; None where unknown)."""
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
        self.class_names = None if class_names is None else [str(c) for c in class_names]
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(f"method_params.{self.name}: unknown key(s) {sorted(unknown)}; "
                             f"allowed: {sorted(self.defaults)}")
        self.params = self.with_defaults(params)
        self.num_classes = num_classes
        self.backbones = list(backbones) if isinstance(backbones, (list, tuple)) else [backbones]
        self.client_backbones = list(client_backbones) if client_backbones is not None else None
        bad = violations(self.param_rules, self.params, None)
        if bad:
            raise ValueError(f"method_params.{self.name}: {bad[0]}")
        self.check_params(self.params)
        self.extra_data: dict[str, ExtraData] = {}
        self.client = self.client_role(self)
        self.strategy = self.strategy_role(self)
        self.evaluator = self.evaluator_role(self)
        check_augment(self.client.augment, f"method {self.name}")
        self.models = [self.build(b) for b in self.backbones]
        self._keys = [state_keys(m) for m in self.models]
        named = [dict(m.named_parameters()) for m in self.models]
        self._trainable = [[k for k in keys if k in n] for keys, n in zip(self._keys, named, strict=True)]
        self._initial = [module_state(m, k) for m, k in zip(self.models, self._keys, strict=True)]

    # ---- the recipe ------------------------------------------------------------------------------
    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Raise ValueError naming the key for invalid params that ``param_rules`` cannot express (all keys
        present: defaults merged). Called when the config is loaded, for every run, and again when the method
        is built (default: nothing to check)."""

    @classmethod
    def check_federation(cls, params: dict[str, Any], federation: dict[str, Any]) -> None:
        """Raise ValueError naming the key for params that do not fit the run's federation block (rounds,
        local_epochs, ...); called when the config is loaded, for every run (default: nothing to check)."""

    def build(self, backbone: nn.Module) -> nn.Module:
        """The model holding every trainable tensor around ``backbone`` (shared, not copied)."""
        raise NotImplementedError(f"method {self.name} must define build()")

    @classmethod
    def own_backbone(cls, params: dict[str, Any]) -> str | None:
        """A registered architecture the method builds from random weights and trains in place of the
        experiment's backbone (whose weights are then not loaded; this arch's input size and normalisation feed
        every client), or None: the experiment's backbone(s) (default)."""
        return None

    def frozen_features(self) -> Callable[[Tensor], Tensor] | None:
        """A feature map that no trainable tensor affects, or None. When given, the engine computes it once per
        image and batches carry features as ``x`` (a head-only method)."""
        return None

    @classmethod
    def artifacts(cls, params: dict[str, Any]) -> dict[str, str]:
        """Per-sample artifacts the method reads: batch extras name -> artifact key (built by rule ``features``)."""
        return {}

    @classmethod
    def extra_datasets(cls, params: dict[str, Any]) -> dict[str, str]:
        """Dataset bundles the method reads besides the run's own: role -> dataset name (built like any dataset;
        ``train_run`` hands each one's train split to ``attach_dataset``). Default: none."""
        return {}

    def attach_dataset(self, role: str, data: ExtraData) -> None:
        """Receive the declared extra dataset ``role`` before round 1 (default: kept in ``extra_data``); a method
        raises ValueError here when the bundle does not fit it."""
        self.extra_data[role] = data

    # ---- models and their state (engine and roles use these) -------------------------------------
    def to(self, device: torch.device | str) -> "Method":
        """Move every model and the initial state (where the server's first state comes from) to ``device``."""
        for m in self.models:
            m.to(device)
        self._initial = [{k: v.to(device) for k, v in init.items()} for init in self._initial]
        return self

    def backbone_index(self, cid: int) -> int:
        """Which backbone (and model) client ``cid`` uses."""
        return 0 if self.client_backbones is None else self.client_backbones[cid]

    @property
    def model(self) -> nn.Module:
        """The one model of a method whose clients share a backbone."""
        if len(self.models) != 1:
            raise ValueError(f"method {self.name} has {len(self.models)} client models: use model_for(cid)")
        return self.models[0]

    def model_for(self, cid: int) -> nn.Module:
        """The model client ``cid`` trains (one per distinct backbone; clients take turns)."""
        return self.models[self.backbone_index(cid)]

    def keys(self, cid: int) -> list[str]:
        """Every state key of client ``cid``'s model, in a fixed order."""
        return self._keys[self.backbone_index(cid)]

    def trainable_keys(self, cid: int) -> list[str]:
        """The parameters among ``keys`` (what the optimiser updates)."""
        return self._trainable[self.backbone_index(cid)]

    def initial_state(self, cid: int, keys: Sequence[str]) -> State:
        """The named tensors of client ``cid``'s model as built (shared references: they are never modified)."""
        init = self._initial[self.backbone_index(cid)]
        return {k: init[k] for k in keys}
