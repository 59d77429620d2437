"""Our FedHPL-paper heterogeneous baselines against HtFLlib's own clients and servers (github.com/TsingZ0/HtFLlib,
HEAD e959261).

HtFLlib's ``system/flcore/clients/client*.py`` and ``servers/server*.py`` are imported at test time from the
checkout named by ``FEDPROMPT_HTFLLIB`` (e.g. ``git -C <mirror> archive HEAD system/flcore system/utils | tar -x -C
/tmp/htfllib``); nothing of it is copied here. Without the variable every test skips (CI has no checkout and no
internet). The import context, the metrics stand-in and the comparison are test_official_pfllib.py's.

Both sides get the same two heterogeneous client models (client 0: our ``resnet_mini_18``, 128 features; client 1:
our ``resnet_mini_50``, 512 features pooled to 128 by ``AdaptiveAvgPool1d``, HtFLlib's ``BaseHeadSplit``
projection, i.e. our ``projection: pool``; each + a 128 -> C linear head), as deep copies split into HtFLlib's
``base`` / ``head``; the same client batches in a fixed order (their ``load_train_data`` / ``load_test_data``
return ours); the same hyperparameters; HtFLlib's plain SGD on the clients; fp32 on the CPU. HtFLlib keeps every
model, upload and server object in ``torch.save`` files (``save_item`` / ``load_item``): here an in-memory store of
deep copies stands in for those files. Their servers' shuffled ``DataLoader`` over the uploaded (prototype,
label) pairs is replaced by one that yields our server's seeded order, and ``random.sample`` of the uploading
clients keeps their order, so that both servers take the same SGD steps. Every stage starts from bit-identical
inputs (our uploads go to their server, our server state and client models to their clients, once compared),
because ReLU and max-pooling kinks amplify rounding (test_official_pfllib.py ``_adopt``).

Compared: FedGH (client update with the global head, per-class mean representations, the server's head training,
evaluation with the new head), FedTGP (update with and without global prototypes, uploaded prototypes, the
adaptive margin, the trained prototype generator and its prototypes, nearest-prototype scores), FedProto (update,
in-training prototypes, their average, nearest-prototype scores), FedGen (update with the generator's regulariser,
the generator's Adam steps on the sample-weighted heads' ensemble, the averaged head), the random draws HtFLlib
makes (labels, noise) replayed from ours. Documented differences (DEVIATIONS.md "FedHPL baselines"; the methods'
docstrings) are asserted as what they are.
Run: ``FEDPROMPT_HTFLLIB=/tmp/htfllib python -m pytest -n 0 tests/test_official_htfllib.py`` (``-s`` prints the
largest differences found).
"""
from __future__ import annotations

import copy
import functools
import importlib
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, Method, RoundInfo, module_state
from fedcore.engine.sampling import stream_seed
from fedcore.methods import fedgen, fedgh, fedtgp
from fedcore.methods.base import prototype_uplink
from fedcore.methods.fedgen import FedGen, sample_labels
from fedcore.methods.fedgh import FedGH
from fedcore.methods.fedproto import FedProto
from fedcore.methods.fedtgp import FedTGP
from official_support import assert_state_close as _close
from official_support import random_batches
from test_official_pfllib import MetricsStandIn, _pfllib_on_path

ENV = "FEDPROMPT_HTFLLIB"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a checkout of HtFLlib "
                                "(github.com/TsingZ0/HtFLlib) to compare our heterogeneous baselines against")

ARCHS, DIM, CLASSES, BATCH, SIZE, LR, EPOCHS = ("resnet_mini_18", "resnet_mini_50"), 128, 4, 8, 16, 0.05, 2
SGD = {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0}  # HtFLlib's client optimiser (plain SGD)
COMMON = {"common_dim": DIM, "projection": "pool"}                   # HtFLlib's AdaptiveAvgPool1d(feature_dim)
METHODS = ("gh", "tgp", "proto", "gen")                               # their client<m>.py / server<m>.py
SEED = 0                                                              # our run seed (server shuffles)


# ---- importing HtFLlib ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def htfl() -> SimpleNamespace:
    """HtFLlib's client and server modules of the compared methods and the metrics stand-in."""
    system = Path(os.environ[ENV]).resolve() / "system"
    if not (system / "flcore" / "clients" / "clientbase.py").is_file():
        pytest.fail(f"{ENV}={system.parent} is not a checkout of TsingZ0/HtFLlib (no system/flcore/clients)")
    # their models.py imports torchvision, whose import of torch._dynamo looks for sklearn's spec: loaded first,
    # before the stand-in sklearn (which has none) is in place
    importlib.import_module("torchvision")
    metrics = MetricsStandIn()
    names = {"cbase": "flcore.clients.clientbase", **{m: f"flcore.clients.client{m}" for m in METHODS},
             **{f"s{m}": f"flcore.servers.server{m}" for m in METHODS}}
    with _pfllib_on_path(system, metrics):   # same top-level names (flcore, utils) and stand-ins as PFLlib's
        mods = {k: importlib.import_module(v) for k, v in names.items()}
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(system), f"imported {mod.__file__}, not from {system}"
    return SimpleNamespace(metrics=metrics, **mods)


class Store:
    """HtFLlib's ``save_item`` / ``load_item`` (one ``torch.save`` file per role and item) in memory: every save
    and load a deep copy, as a file round trip is; a missing item is None, as theirs."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], Any] = {}
        self.loaded: dict[tuple[str, str], Any] = {}   # the last copy handed out (their servergen trains it)

    def save_item(self, item: Any, role: str, name: str, path: str | None = None) -> None:
        """Keep a copy."""
        self.items[(role, name)] = copy.deepcopy(item)

    def load_item(self, role: str, name: str, path: str | None = None) -> Any:
        """A copy, or None."""
        self.loaded[(role, name)] = copy.deepcopy(self.items.get((role, name)))
        return self.loaded[(role, name)]


@pytest.fixture
def store(htfl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A fresh in-memory store behind every HtFLlib module's ``save_item`` / ``load_item``."""
    s = Store()
    for mod in vars(htfl).values():
        if isinstance(mod, ModuleType):
            for name in ("save_item", "load_item"):
                if hasattr(mod, name):
                    monkeypatch.setattr(mod, name, getattr(s, name))
    return s


# ---- the shared setting ---------------------------------------------------------------------------------------
# ``n`` batches of BATCH random images (3 x SIZE x SIZE), labels from the classes not in ``missing``
_batches = functools.partial(random_batches, batch=BATCH, classes=CLASSES, size=SIZE)


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch (HtFLlib's train loader does not
    shuffle; its ``collect_protos`` pass reads the same batches)."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid),
                      settings=TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=dict(SGD)))


def _ours(cls: type[Method], **params: Any) -> Method:
    """Our method with client 0 on resnet_mini_18 and client 1 on resnet_mini_50 (seeded draws)."""
    torch.manual_seed(0)
    return cls([prompt_adapter(build_backbone(a)) for a in ARCHS], CLASSES, {**COMMON, **params},
               client_backbones=[0, 1])


class Base(nn.Module):
    """HtFLlib's ``model.base``: the backbone, then the map to the common width (their ``AdaptiveAvgPool1d`` in
    place of ``fc``; here our pooling module, the same op)."""

    def __init__(self, net: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self.net, self.proj = net, proj

    def forward(self, x: Tensor) -> Tensor:
        """Features of width DIM."""
        return self.proj(self.net(x))


class Split(nn.Module):
    """HtFLlib's ``BaseHeadSplit`` (``base``, ``head``; forward = head(base(x))) of copies of our model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base = Base(copy.deepcopy(model.net), copy.deepcopy(model.proj))
        self.head = copy.deepcopy(model.head)

    def forward(self, x: Tensor) -> Tensor:
        """Logits."""
        return self.head(self.base(x))


def _named(model: nn.Module) -> dict[str, Tensor]:
    """Their Split's parameters and buffers under our names (``base.`` dropped)."""
    items = list(model.named_parameters()) + list(model.named_buffers())
    return {k.removeprefix("base."): v.detach().clone() for k, v in items}


def _adopt(model: nn.Module, ours: dict[str, Tensor]) -> None:
    """Our tensors (parameters and buffers) into their model, once compared: the next stage starts bit-identical."""
    theirs = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for k, t in theirs.items():
            t.copy_(ours[k.removeprefix("base.")])


def _args(**extra: Any) -> SimpleNamespace:
    """The ``args`` their clients and ``Server.__init__`` read. ``save_folder_name`` contains ``temp`` (and is not
    ``temp``) so that their ``Client.__init__`` builds no model of its own: the test stores ours."""
    return SimpleNamespace(
        algorithm="compare", dataset="none", device="cpu", save_folder_name="mem_temp",
        save_folder_name_full="mem_temp", models_folder_name="",
        num_classes=CLASSES, feature_dim=DIM, batch_size=BATCH, local_learning_rate=LR, local_epochs=EPOCHS,
        few_shot=0, global_rounds=1, join_ratio=1.0, random_join_ratio=False, time_select=False, goal="test",
        time_threthold=float("inf"), top_cnt=100, auto_break=False, eval_gap=1, client_drop_rate=0.0,
        train_slow_rate=0.0, send_slow_rate=0.0, **extra)


def _their_clients(htfl: SimpleNamespace, cls: type, args: SimpleNamespace, store: Store, method: Method,
                   data: dict[int, list], test: list) -> list:
    """Their client ``cls`` per client, loaders returning our batches (train: ``data[c]``, test: ``test``), each
    with a copy of our client model in the store; built under a forked torch generator (their ``__init__``
    reseeds the global one)."""
    class Driven(cls):
        """``cls`` fed by fixed batches (their loaders read .npz files)."""

        def __init__(self, *a: Any, fixed: list, **kw: Any) -> None:
            self.fixed_train = fixed
            super().__init__(*a, **kw)

        def load_train_data(self, batch_size: int | None = None) -> list:
            """The fixed training batches."""
            return list(self.fixed_train)

        def load_test_data(self, batch_size: int | None = None) -> list:
            """The fixed test batches."""
            return list(test)

    clients = []
    with torch.random.fork_rng(devices=[]):
        for c, batches in data.items():
            clients.append(Driven(args, id=c, train_samples=sum(len(y) for _, y in batches),
                                  test_samples=sum(len(y) for _, y in test), train_slow=False, send_slow=False,
                                  fixed=batches))
            store.save_item(Split(method.model_for(c)), clients[-1].role, "model")
    return clients


def _their_server(cls: type, base: ModuleType, args: SimpleNamespace, clients: list, **attrs: Any) -> Any:
    """Their server ``cls`` with ``clients``, all selected: ``Server.__init__`` (from args) without the subclass's,
    which reads every client's data files; the subclass's attributes given as ``attrs``."""
    server = cls.__new__(cls)
    base.Server.__init__(server, SimpleNamespace(**vars(args), num_clients=len(clients)), 0)
    server.clients, server.selected_clients = list(clients), list(clients)
    server.num_clients = server.num_join_clients = server.current_num_join_clients = len(clients)
    for k, v in attrs.items():
        setattr(server, k, v)
    return server


def _our_order(stream: int, rnd: int) -> Callable[..., Any]:
    """A stand-in for their server's ``DataLoader(pairs, batch_size, drop_last=False, shuffle=True)``: each pass
    (``__iter__``) takes the next permutation of our server's seeded generator for round ``rnd`` (fedgh.py:114,
    fedtgp.py:100), so both servers see the same minibatches in the same order."""
    g = torch.Generator().manual_seed(stream_seed(SEED, rnd, 0, stream))

    class Ordered:
        """Minibatches of (prototype, label) pairs in our order."""

        def __init__(self, pairs: list, batch_size: int, drop_last: bool = False, shuffle: bool = True) -> None:
            assert shuffle and not drop_last
            self.pairs, self.bs = list(pairs), batch_size

        def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
            perm = torch.randperm(len(self.pairs), generator=g).tolist()
            for i in range(0, len(perm), self.bs):
                chunk = [self.pairs[j] for j in perm[i:i + self.bs]]
                yield torch.stack([p for p, _ in chunk]), torch.tensor([int(y) for _, y in chunk])

    return Ordered


def _in_order() -> SimpleNamespace:
    """``random`` for their server: ``sample`` keeps the clients' order (ours: ascending cid)."""
    return SimpleNamespace(sample=lambda xs, k: list(xs)[:k])


def _fit(method: Method, cid: int, state: dict, downlink: dict, data: ClientData) -> tuple[dict, FitResult]:
    """Our client's round, its model in train mode as the engine leaves it."""
    method.model_for(cid).train()
    return method.client.fit(cid, state, downlink, data, data.settings)


def _model_state(method: Method, cid: int) -> dict[str, Tensor]:
    """Every tensor of our client's model after its update (our prototype buffers excluded)."""
    return module_state(method.model_for(cid), [k for k in method.keys(cid) if k not in ("protos", "proto_mask")])


def _uploaded(up: dict[str, Tensor], theirs: dict[int, Tensor]) -> dict[str, Tensor]:
    """Their per-class dict of an upload as our rows (the same classes, ascending)."""
    assert sorted(theirs) == up["labels"].tolist(), "the uploaded classes differ"
    return {"protos": torch.stack([theirs[int(c)] for c in up["labels"]])}


def _upload_dict(up: dict[str, Tensor]) -> dict[int, Tensor]:
    """Our upload as their per-class dict (classes ascending)."""
    return {int(c): p.clone() for c, p in zip(up["labels"], up["protos"])}


# ---- FedGH ----------------------------------------------------------------------------------------------------
def test_fedgh_local_update_representations_server_head_and_scores(htfl, store, monkeypatch):
    """FedGH (clientgh.py, servergh.py): the client's CE update behind the global head, its per-class mean
    representations (eval mode), the server's SGD on the head over the (mean, label) pairs (lr ``server_lr``,
    ``server_epochs``, batch size = the clients', servergh.py:93-108) and each client's logits with the new head,
    two rounds."""
    method = _ours(FedGH, server_lr=0.1, server_epochs=2, server_batch_size=3)
    data = {0: _batches(3, 10, missing=(2,)), 1: _batches(2, 11, missing=(0, 3))}
    test = _batches(1, 12)
    args = _args(server_learning_rate=0.1, server_epochs=2)
    clients = _their_clients(htfl, htfl.gh.clientGH, args, store, method, data, test)
    # their server batches the pairs by the clients' batch size (servergh.py:95): here our server_batch_size 3
    server = _their_server(htfl.sgh.FedGH, htfl.sgh, args, clients, server_learning_rate=0.1, server_epochs=2,
                           CEloss=nn.CrossEntropyLoss(), batch_size=3)
    monkeypatch.setattr(htfl.sgh, "random", _in_order())
    store.save_item(store.load_item(clients[0].role, "model").head, "Server", "head")   # servergh.py:29-30

    state, states = method.strategy.init_state(2), {c: method.client.init_state(c) for c in data}
    _close(state["model"], {"head." + k: v for k, v in _named(store.load_item("Server", "head")).items()},
           "FedGH initial global head (client 0's)")
    for r in (1, 2):
        server.send_parameters()
        if r == 2:   # what each client receives, and how it scores (their evaluate() after send_parameters)
            htfl.metrics.scored.clear()
            for c, client in enumerate(clients):
                client.test_metrics()
                model = method.model_for(c).eval()
                method.evaluator.load(model, c, state, states[c], _data(c, data[c]))
                ours = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {}))
                                  for x, y in test])
                _close({"logits": ours}, {"logits": torch.from_numpy(htfl.metrics.scored[-1])},
                       f"FedGH round {r} client {c} test logits")
        results = []
        for c, client in enumerate(clients):
            client.train()
            client.collect_protos()
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            their_model = store.load_item(client.role, "model")
            _close(_model_state(method, c), _named(their_model), f"FedGH round {r} client {c} model")
            _close(res.uplink, _uploaded(res.uplink, store.load_item(client.role, "protos")),
                   f"FedGH round {r} client {c} per-class representations", ["protos"])
            _adopt(their_model, _model_state(method, c))
            store.save_item(their_model, client.role, "model")
            store.save_item(_upload_dict(res.uplink), client.role, "protos")
        state = method.strategy.aggregate(RoundInfo(r, 2, 1.0, SEED), state, results)
        monkeypatch.setattr(htfl.sgh, "DataLoader", _our_order(fedgh.SERVER_STREAM, r))
        server.receive_protos()
        server.train_head()
        head = store.load_item("Server", "head")
        _close(state["model"], {"head." + k: v for k, v in _named(head).items()}, f"FedGH round {r} global head")
        _adopt(head, {k.removeprefix("head."): v for k, v in state["model"].items()})
        store.save_item(head, "Server", "head")


# ---- FedTGP ---------------------------------------------------------------------------------------------------
def _their_tgp(htfl: SimpleNamespace, gen: dict[str, Tensor]) -> nn.Module:
    """Their ``Trainable_Global_Prototypes`` holding our G_p's tensors (servertgp.py:171-192)."""
    tgp = htfl.stgp.Trainable_Global_Prototypes(CLASSES, DIM, DIM, "cpu")
    _set_tgp(tgp, gen)
    return tgp


def _set_tgp(tgp: nn.Module, gen: dict[str, Tensor]) -> None:
    """Copy our G_p into theirs."""
    with torch.no_grad():
        for k, t in _tgp_tensors(tgp).items():
            t.copy_(gen[k])


def _tgp_tensors(tgp: nn.Module) -> dict[str, Tensor]:
    """Their G_p's tensors under our names (fedtgp.GENERATOR)."""
    return {"embedding": tgp.embedings.weight, "w1": tgp.middle[0][0].weight, "b1": tgp.middle[0][0].bias,
            "w2": tgp.fc.weight, "b2": tgp.fc.bias}


class MSERecorder(nn.Module):
    """Their client's ``loss_mse``, recording every value it returns (their test scores each (sample, class) pair
    with it, clienttgp.py:109-113 / clientproto.py:89-93)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[Tensor] = []

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        """``nn.MSELoss()(a, b)``, recorded when no gradient is taken (the test pass)."""
        out = nn.functional.mse_loss(a, b)
        if not torch.is_grad_enabled():
            self.values.append(out.detach().clone())
        return out


def _check_prototype_scores(method: Method, state: dict, states: dict, clients: list, data: dict, test: list,
                            what: str) -> None:
    """Their ``test_metrics`` (per sample and global prototype: MSE, a mean over the width; argmin) against our
    logits (minus the squared distance, a sum over the width): ours = −DIM · theirs where they have a prototype,
    −inf (ours) / inf (theirs) where not; the same accuracy."""
    for c, client in enumerate(clients):
        client.loss_mse = MSERecorder()
        correct, total, _ = client.test_metrics()
        model = method.model_for(c).eval()
        method.evaluator.load(model, c, state, states[c], _data(c, data[c]))
        ours = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {})) for x, y in test])
        have = state["mask"] > 0
        theirs = torch.stack(client.loss_mse.values).reshape(len(ours), int(have.sum()))
        _close({"scores": ours[:, have] / -DIM}, {"scores": theirs}, f"{what} client {c} test scores (MSE)")
        assert bool(torch.isneginf(ours[:, ~have]).all())
        labels = torch.cat([y for _, y in test])
        assert (total, correct) == (len(labels), int((ours.argmax(1) == labels).sum()))


def _pre_update_prototypes(method: Method, cid: int, before: dict[str, Tensor], data: ClientData) -> dict:
    """Our upload's rule (eval-mode class means of one pass) applied to a copy of client ``cid``'s model holding
    ``before``, its tensors before the round's update."""
    model = copy.deepcopy(method.model_for(cid))
    model.load_state_dict(before, strict=False)
    return prototype_uplink(*method.client.class_sums(model, data))


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor:UserWarning")   # servertgp.py:186 on a tensor
def test_fedtgp_local_update_prototypes_margin_generator_and_scores(htfl, store, monkeypatch):
    """FedTGP (clienttgp.py, servertgp.py), two rounds: the client's update (round 1: CE only, no global
    prototypes; round 2: CE + λ·MSE to G_p's prototypes), its eval-mode per-class prototypes, the server's margin
    (servertgp.py:102-115, 139), ``server_epochs`` of SGD on G_p (servertgp.py:120-155: lr and batch size the
    clients', as our server_lr and server_batch_size are set here), the prototypes G_p(c) of every class and each
    client's nearest-prototype scores."""
    method = _ours(FedTGP, lam=10.0, server_epochs=3, server_lr=LR, server_batch_size=3, margin_threshold=100.0)
    data = {0: _batches(3, 20, missing=(2,)), 1: _batches(2, 21, missing=(0, 3))}
    test = _batches(1, 22)
    args = _args(lamda=10.0, server_epochs=3, margin_threthold=100.0)
    clients = _their_clients(htfl, htfl.tgp.clientTGP, args, store, method, data, test)
    server = _their_server(htfl.stgp.FedTGP, htfl.stgp, args, clients, server_learning_rate=LR, batch_size=3,
                           server_epochs=3, margin_threthold=100.0, feature_dim=DIM, CEloss=nn.CrossEntropyLoss())
    state, states = method.strategy.init_state(2), {c: method.client.init_state(c) for c in data}
    store.save_item(_their_tgp(htfl, state["generator"]), "Server", "TGP")

    for r in (1, 2):
        assert (store.load_item("Server", "global_protos") is None) == (r == 1)   # round 1: CE only on both
        results = []
        for c, client in enumerate(clients):
            client.train()   # trains, then collect_protos (clienttgp.py:60)
            before = _model_state(method, c)
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            their_model = store.load_item(client.role, "model")
            _close(_model_state(method, c), _named(their_model), f"FedTGP round {r} client {c} model")
            # UNDOCUMENTED difference: clientTGP.train calls collect_protos (clienttgp.py:60) BEFORE it saves the
            # trained model (clienttgp.py:61), and collect_protos loads the SAVED model (clienttgp.py:69): their
            # prototypes are the eval-mode class means of the model as it was before this round's update (round 1:
            # the initial model). Ours (fedtgp.py:66-68, base.py:296-311) take them from the trained model.
            theirs = _uploaded(res.uplink, store.load_item(client.role, "protos"))
            _close(_pre_update_prototypes(method, c, before, _data(c, data[c])), theirs,
                   f"FedTGP round {r} client {c} prototypes (theirs: of the model before the update)", ["protos"])
            gap = float((res.uplink["protos"] - theirs["protos"]).abs().max())
            print(f"FedTGP round {r} client {c} prototypes, ours (trained) vs theirs (pre-update): max abs diff "
                  f"{gap:.2e}, largest entry {float(theirs['protos'].abs().max()):.2e}")
            assert not torch.allclose(res.uplink["protos"], theirs["protos"], rtol=1e-2, atol=1e-2)
            _adopt(their_model, _model_state(method, c))
            store.save_item(their_model, client.role, "model")
            store.save_item(_upload_dict(res.uplink), client.role, "protos")
        state = method.strategy.aggregate(RoundInfo(r, 2, 1.0, SEED), state, results)
        monkeypatch.setattr(htfl.stgp, "DataLoader", _our_order(fedtgp.SERVER_STREAM, r))
        server.receive_protos()
        margin = min(server.max_gap.item(), server.margin_threthold)
        _close({"margin": state["margin"]}, {"margin": torch.tensor(margin)}, f"FedTGP round {r} margin")
        assert 0 < margin < 100.0                                               # the distance, not the cap
        server.update_TGP()
        tgp = store.load_item("Server", "TGP")
        _close(state["generator"], {k: v.detach() for k, v in _tgp_tensors(tgp).items()}, f"FedTGP round {r} G_p")
        glob = store.load_item("Server", "global_protos")
        assert sorted(glob) == list(range(CLASSES))                              # every class, uploaded or not
        _close({"protos": state["protos"]}, {"protos": torch.stack([glob[k] for k in range(CLASSES)])},
               f"FedTGP round {r} global prototypes")
        assert bool((state["mask"] > 0).all())
        # round 2 (and the scores) from our server's exact tensors
        _set_tgp(tgp, state["generator"])
        store.save_item(tgp, "Server", "TGP")
        store.save_item({k: state["protos"][k].clone() for k in range(CLASSES)}, "Server", "global_protos")
        _check_prototype_scores(method, state, states, clients, data, test, f"FedTGP round {r}")


# ---- FedProto -------------------------------------------------------------------------------------------------
def test_fedproto_local_update_in_training_prototypes_average_and_scores(htfl, store):
    """FedProto (clientproto.py, serverproto.py), two rounds: the client's update (round 1 CE only; round 2 CE +
    λ·MSE to the global prototypes, a class without one adding nothing), the prototypes it collects while training
    (every batch of every epoch, train mode, clientproto.py:55-57), the server's per-class mean over the clients
    that uploaded the class (``weighting: clients``, serverproto.py:75-90; a class nobody has gets none) and each
    client's nearest-prototype scores."""
    method = _ours(FedProto, lam=10.0, weighting="clients")
    data = {0: _batches(3, 30, missing=(3,)), 1: _batches(2, 31, missing=(1, 3))}   # nobody has class 3
    test = _batches(1, 32)
    args = _args(lamda=10.0)
    clients = _their_clients(htfl, htfl.proto.clientProto, args, store, method, data, test)
    server = _their_server(htfl.sproto.FedProto, htfl.sproto, args, clients)
    state, states = method.strategy.init_state(2), {c: method.client.init_state(c) for c in data}

    for r in (1, 2):
        assert (store.load_item("Server", "global_protos") is None) == (r == 1)   # round 1: CE only on both
        results = []
        for c, client in enumerate(clients):
            client.train()
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            their_model = store.load_item(client.role, "model")
            _close(_model_state(method, c), _named(their_model), f"FedProto round {r} client {c} model")
            _close(res.uplink, _uploaded(res.uplink, store.load_item(client.role, "protos")),
                   f"FedProto round {r} client {c} prototypes (while training)", ["protos"])
            _adopt(their_model, _model_state(method, c))
            store.save_item(their_model, client.role, "model")
            store.save_item(_upload_dict(res.uplink), client.role, "protos")
        state = method.strategy.aggregate(RoundInfo(r, 2, 1.0, SEED), state, results)
        server.receive_protos()
        glob = store.load_item("Server", "global_protos")
        assert sorted(glob) == [0, 1, 2] and state["mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
        _close({"protos": state["protos"][:3]}, {"protos": torch.stack([glob[k] for k in range(3)])},
               f"FedProto round {r} global prototypes")
        assert not bool(state["protos"][3].any())
        # round 2 (and the scores) from our server's exact prototypes, a class without one absent as theirs
        store.save_item(defaultdict(list, {k: state["protos"][k].clone() for k in range(3)}), "Server",
                        "global_protos")
        _check_prototype_scores(method, state, states, clients, data, test, f"FedProto round {r}")


# ---- FedGen ---------------------------------------------------------------------------------------------------
# Adam lr 0.01 (HtFLlib: 0.1): its normalised steps amplify the rounding of near-zero gradient entries in
# proportion to lr (at 0.1 one entry of fc1.weight was 1.3e-6 apart after a round of 5 steps)
NOISE, HIDDEN, GEN_STEPS, GEN_LR = 6, 10, 5, 0.01
ADAM_ATOL = 5e-6


def _gen_names(theirs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Their Generator's parameters under our names (fc1.0 = fc1, fc1.1 = bn, fc = fc2; servergen.py:152-178)."""
    names = {"fc1.0.": "fc1.", "fc1.1.": "bn.", "fc.": "fc2."}
    return {names[k[:k.rindex(".") + 1]] + k[k.rindex(".") + 1:]: v for k, v in theirs.items()}


class Draws:
    """Their random draws replayed from ours. Labels: their ``np.random.choice(qualified_labels, n)`` becomes our
    ``sample_labels`` over the same label counts, from the global torch generator on the clients (as our client)
    or from our server's seeded generator (``server``), where their ``torch.rand`` noise in ``Generator.forward``
    (servergen.py:170) is then that generator's next draw too (ours: labels, then noise, fedgen.py:205-207)."""

    def __init__(self) -> None:
        self.server: torch.Generator | None = None
        self.noise: list[Tensor] = []
        self.random = SimpleNamespace(choice=self.choice)

    def choice(self, labels: list[int], n: int) -> Any:
        """``n`` labels drawn in proportion to the counts of ``labels``, as ours."""
        counts = torch.bincount(torch.as_tensor(labels), minlength=CLASSES)
        drawn = sample_labels(counts, n, self.server)
        if self.server is not None:
            self.noise.append(torch.rand(n, NOISE, generator=self.server))
        return drawn.numpy()

    def rand(self, *args: Any, **kwargs: Any) -> Tensor:
        """The stashed server noise, else torch's global draw."""
        return self.noise.pop(0) if self.noise else torch.rand(*args, **kwargs)


class TorchWithDraws:
    """``torch`` for their servergen module (its ``Generator.forward`` reads the module's ``torch.rand``)."""

    def __init__(self, draws: Draws) -> None:
        self.rand = draws.rand

    def __getattr__(self, name: str) -> Any:
        """Everything else: torch's."""
        return getattr(torch, name)


def test_fedgen_regularised_update_generator_training_head_average_and_scores(htfl, store, monkeypatch):
    """FedGen (clientgen.py, servergen.py) with our HtFLlib options (``teacher_weights: samples``, a fresh Adam per
    round): the client's update CE + CE(head(G(z, ŷ)), ŷ) (clientgen.py:46-57), the label counts, the server's
    Adam steps on G against the sample-weighted ensemble of the uploaded heads (servergen.py:111-132), the
    sample-weighted head average (servergen.py:134-148), what a client receives (the head) and its logits, and a
    round-2 update with the trained G. HtFLlib's labels and noise are replayed from our draws (``Draws``)."""
    method = _ours(FedGen, noise_dim=NOISE, hidden_dim=HIDDEN, generator_lr=GEN_LR, generator_steps=GEN_STEPS,
                   generator_batch_size=BATCH, teacher_weights="samples", keep_generator_optimizer=False)
    data = {0: _batches(3, 40, missing=(2,)), 1: _batches(2, 41, missing=(0, 3))}
    test = _batches(1, 42)
    args = _args(noise_dim=NOISE, hidden_dim=HIDDEN, generator_learning_rate=GEN_LR, server_epochs=GEN_STEPS)
    draws = Draws()
    monkeypatch.setattr(htfl.gen, "np", SimpleNamespace(random=draws.random))
    monkeypatch.setattr(htfl.sgen, "np", SimpleNamespace(random=draws.random))
    monkeypatch.setattr(htfl.sgen, "torch", TorchWithDraws(draws))
    monkeypatch.setattr(htfl.sgen, "random", _in_order())
    clients = _their_clients(htfl, htfl.gen.clientGen, args, store, method, data, test)
    qualified = [y for client in clients for y in range(CLASSES) for _ in range(int(client.sample_per_class[y]))]
    for client in clients:
        client.qualified_labels = qualified                          # servergen.py:40-45
    server = _their_server(htfl.sgen.FedGen, htfl.sgen, args, clients, generator_learning_rate=GEN_LR,
                           server_epochs=GEN_STEPS, loss=nn.CrossEntropyLoss(), qualified_labels=qualified)
    state, states = method.strategy.init_state(2), {c: method.client.init_state(c) for c in data}
    their_gen = htfl.sgen.Generator(NOISE, CLASSES, HIDDEN, DIM, "cpu")
    _adopt_gen(their_gen, state["generator"])
    store.save_item(their_gen, "Server", "generative_model")
    store.save_item(store.load_item(clients[0].role, "model").head, "Server", "head")   # servergen.py:49-50

    for r in (1, 2):
        server.send_parameters()
        results = []
        for c, client in enumerate(clients):
            down = method.strategy.configure(state, c)
            if r == 1:
                # documented: our round 1 is CE only (no G yet); HtFLlib regularises with its untrained G. Our
                # client given that G and the label space reproduces theirs: the gate is the only difference.
                assert "generator" not in down
                _, ce_only = _fit(method, c, states[c], down, _data(c, data[c]))
                down = {**down, "generator": state["generator"],
                        "label_counts": torch.stack([cl.sample_per_class for cl in clients]).sum(0)}
            torch.manual_seed(100 + c)
            client.train()
            torch.manual_seed(100 + c)
            states[c], res = _fit(method, c, states[c], down, _data(c, data[c]))
            results.append(res)
            their_model = store.load_item(client.role, "model")
            _close(_model_state(method, c), _named(their_model), f"FedGen round {r} client {c} model")
            if r == 1:
                assert not torch.allclose(ce_only.uplink["model"]["head.weight"], res.uplink["model"]["head.weight"])
            assert torch.equal(res.uplink["label_counts"], client.sample_per_class)
            _adopt(their_model, _model_state(method, c))
            store.save_item(their_model, client.role, "model")
        state = method.strategy.aggregate(RoundInfo(r, 2, 1.0, SEED), state, results)
        draws.server = torch.Generator().manual_seed(stream_seed(SEED, r, 0, fedgen.SERVER_STREAM))
        kept = _named(store.load_item("Server", "generative_model"))
        server.receive_ids()
        server.train_generator()
        draws.server = None
        assert not draws.noise
        trained = store.loaded[("Server", "generative_model")]   # their train_generator's G (never saved)
        # fc1.bias feeds G's BatchNorm in train mode (batch statistics), which subtracts it again: its gradient is
        # 0 up to rounding (~1e-9), which Adam's normalisation turns into ±lr steps on either side. It has no
        # effect on G's output, so it is left out and G's output on a fixed batch compared instead.
        # Adam divides each entry's gradient by its own running magnitude: an entry whose gradient nearly cancels
        # over the batch (noise and one-hot columns of fc1.weight, whose BatchNorm centres the gradient) carries the
        # two sides' ~1e-7 relative rounding (our einsum ensemble, their loop over heads) into its step: up to
        # ~1.2e-6 at lr 0.01 over the data draws tried, hence ADAM_ATOL for G's tensors
        theirs_g = _gen_names(_named(trained))
        worst = max(float((v - theirs_g[k]).abs().max()) for k, v in state["generator"].items() if k != "fc1.bias")
        print(f"FedGen round {r} generator (Adam steps): max abs diff {worst:.2e}")
        assert worst < ADAM_ATOL
        _check_generator_output(method, state["generator"], trained)
        server.aggregate_parameters()
        head = store.load_item("Server", "head")
        _close(state["model"], {"head." + k: v for k, v in _named(head).items()}, f"FedGen round {r} head average")
        # documented: HtFLlib's servergen.py never saves G after train_generator (servergen.py:73, 111-132): its
        # stored G stays the initial one; ours keeps the trained G. Round 2 here starts from our trained G.
        assert all(torch.equal(v, kept[k]) for k, v in _named(store.load_item("Server", "generative_model")).items())
        assert not torch.equal(kept["fc.weight"], _named(trained)["fc.weight"])   # and it was trained
        _adopt_gen(trained, state["generator"])
        store.save_item(trained, "Server", "generative_model")
        _adopt(head, {k.removeprefix("head."): v for k, v in state["model"].items()})
        store.save_item(head, "Server", "head")
    server.send_parameters()
    for c, client in enumerate(clients):   # what each client receives (the averaged head) and its logits
        client.test_metrics()
        model = method.model_for(c).eval()
        method.evaluator.load(model, c, state, states[c], _data(c, data[c]))
        ours = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {})) for x, y in test])
        _close({"logits": ours}, {"logits": torch.from_numpy(htfl.metrics.scored[-1])}, f"FedGen client {c} logits")


def _adopt_gen(gen: nn.Module, ours: dict[str, Tensor]) -> None:
    """Our G's parameters into their Generator."""
    names = dict(zip(_gen_names(dict(gen.named_parameters())), dict(gen.named_parameters()).values()))
    with torch.no_grad():
        for k, t in names.items():
            t.copy_(ours[k])


def _check_generator_output(method: Method, ours: dict[str, Tensor], theirs: nn.Module) -> None:
    """Our G and their G (train mode, batch statistics, as both use it) on the same labels and noise."""
    g = torch.Generator().manual_seed(7)
    labels, noise = torch.randint(CLASSES, (BATCH,), generator=g), torch.rand(BATCH, NOISE, generator=g)
    gen = method.loaded_generator(ours, "cpu")
    with torch.no_grad():
        mine = gen(labels, noise)
        inner = theirs.fc1(torch.cat((noise, nn.functional.one_hot(labels, CLASSES)), dim=1))
        # the two fc1.bias differ by up to ~0.4 (above), shifts that BatchNorm removes only up to fp32 rounding of
        # the shifted pre-activations (then divided by their batch std): 1e-5 here, not RTOL/ATOL
        torch.testing.assert_close(mine, theirs.fc(inner), rtol=1e-4, atol=1e-5)
        print(f"FedGen generator output: max abs diff {float((mine - theirs.fc(inner)).abs().max()):.2e}")
