"""Our FedPFT-paper baselines against Fling (github.com/FLAIR-Community/Fling, HEAD faebd06), the framework of
FedPFT's authors' group and the official code of FedCAC.

Fling's ``fling/component/client/*_client.py``, ``group/*_group.py``, ``utils/compress_utils/fed_avg.py`` and
``model/resnet.py`` are imported at test time from the checkout named by ``FEDPROMPT_FLING_OFFICIAL`` (e.g. ``git -C
<mirror> archive HEAD | tar -x -C /tmp/fling_official``); nothing of it is copied here. Without the variable every
test skips (CI has no checkout and no internet). Only its harness's imports are stood in (easydict, prettytable,
tensorboard's ``SummaryWriter``, einops, timm, matplotlib: configs, logging, plots and models not compared).

Both sides get the same model: our ``resnet8_pft`` extractor + linear head (FedPFT's CIFAR-10 ResNet-8 at full width:
Fling's ResNet fixes the first stage at 64 channels, so no mini width exists there) loaded into Fling's own ``resnet8``
(``pre_conv``/``pre_bn``/``layers.i``/``fc``; ``fedrod_head`` for FedRoD) by a name map; the same client batches in a
fixed order (their ``train_dataloader`` / ``test_dataloader`` replaced by our batches); the same SGD (lr, momentum
0.9 as Fling's flzoo configs, no weight decay), fresh each round on both sides; fp32 on the CPU. Their clients and
groups are driven through the calls their ``personalized_model_pipeline`` makes (``client.train``, ``group.aggregate``
with its ``sync``, ``client.test``), ours through the roles. Compared per method: every trained tensor, the client
state, the server step, what each client starts the next round from and its evaluation; over two rounds each round
starts from bit-identical inputs (their clients adopt ours once compared, as test_official_pfllib.py ``_adopt``).
Documented differences (DEVIATIONS.md "FedPFT baselines", "FedHPL baselines"; the methods' docstrings) are
asserted as what they are. Run: ``FEDPROMPT_FLING_OFFICIAL=/tmp/fling_official python -m pytest -n 0
tests/test_official_fling.py`` (``-s`` prints the largest differences found).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.backbones.resnet import StemResNet
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, Method, RoundInfo, module_state
from fedcore.methods.fedavg import FedAvg
from fedcore.methods.fedbn import FedBN
from fedcore.methods.fedcac import FedCAC, collaborators, customised_model, overlap_rates
from fedcore.methods.fedper import FedPer
from fedcore.methods.fedprox import FedProx
from fedcore.methods.fedrod import COUNTS, FedRoD
from fedcore.methods.pfedsd import PFedSD
from fedcore.methods.scaffold import Scaffold
from fedcore.official_code import checkout_on_path, standin_modules
from official_support import assert_state_close as _close

ENV = "FEDPROMPT_FLING_OFFICIAL"
pytestmark = [pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a checkout of Fling "
                                 "(github.com/FLAIR-Community/Fling) to compare our FedPFT baselines against"),
              pytest.mark.filterwarnings("ignore:Trying to use launcher type")]   # their get_model: no compile

ARCH, CLASSES, BATCH, SIZE, LR, EPOCHS = "resnet8_pft", 5, 8, 16, 0.05, 2   # 16 px: 4x4 after the stem
SGD = {"name": "sgd", "lr": LR, "momentum": 0.9, "weight_decay": 0.0}   # Fling's flzoo optimiser (no decay)
NBT = "num_batches_tracked"
MODULES = {"base_client": "fling.component.client.base_client", "cac": "fling.component.client.fedcac_client",
           "sd": "fling.component.client.pfedsd_client", "rod": "fling.component.client.fedrod_client",
           "prox": "fling.component.client.fedprox_client", "scaffold": "fling.component.client.scaffold_client",
           "base_group": "fling.component.group.base_group", "cac_group": "fling.component.group.fedcac_group",
           "scaffold_group": "fling.component.group.scaffold_group", "server": "fling.component.server",
           "resnet": "fling.model.resnet"}


# ---- importing Fling ------------------------------------------------------------------------------------------
class Config(dict):
    """easydict's ``EasyDict`` (their configs): a dict whose keys are also attributes, nested dicts converted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for k, v in self.items():
            if isinstance(v, dict) and not isinstance(v, Config):
                self[k] = Config(v)

    def __getattr__(self, key: str) -> Any:
        """The item ``key``."""
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e

    def __setattr__(self, key: str, value: Any) -> None:
        """Set the item ``key``."""
        self[key] = value


class Quiet:
    """Their ``Logger`` (a tensorboard ``SummaryWriter`` writing files): discards everything."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        """Any logging call: a no-op."""
        return lambda *args, **kwargs: None


def _standins() -> dict[str, ModuleType]:
    """What only their harness imports (configs, logging, tables, the ViT/Swin models, plots)."""
    return standin_modules({
        "easydict": {"EasyDict": Config}, "prettytable": {"PrettyTable": Quiet},
        "einops": {"rearrange": None, "repeat": None}, "einops.layers": {}, "einops.layers.torch": {"Rearrange": Quiet},
        "timm": {}, "timm.models": {}, "timm.models.layers": {"DropPath": Quiet, "to_2tuple": None,
                                                              "trunc_normal_": None},
        "matplotlib": {"pyplot": None}, "matplotlib.pyplot": {}})


@contextlib.contextmanager
def _tensorboard_standin() -> Iterator[None]:
    """``torch.utils.tensorboard`` (their ``Logger``'s base class) as a stand-in while their modules load; a
    submodule of torch, so not a ``checkout_on_path`` stand-in (that would unregister torch)."""
    name, saved = "torch.utils.tensorboard", sys.modules.get("torch.utils.tensorboard")
    sys.modules[name] = standin_modules({name: {"SummaryWriter": Quiet}})[name]
    try:
        yield
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


@pytest.fixture(scope="module")
def fling() -> SimpleNamespace:
    """Fling's client, group, server and model modules."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "fling" / "component" / "client" / "fedcac_client.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of FLAIR-Community/Fling (no fling/component/client)")
    importlib.import_module("torchvision")   # their data transforms import it; loaded once, outside the context
    with _tensorboard_standin(), checkout_on_path(root, ("fling", "flzoo"), _standins()):
        mods = {k: importlib.import_module(v) for k, v in MODULES.items()}
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return SimpleNamespace(**mods)


# ---- the shared setting ---------------------------------------------------------------------------------------
def _batches(n: int, seed: int, missing: tuple[int, ...] = ()) -> list[tuple[Tensor, Tensor]]:
    """``n`` batches of BATCH images (3 x SIZE x SIZE) with labels drawn from the classes not in ``missing``."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([c for c in range(CLASSES) if c not in missing])
    return [(torch.randn(BATCH, 3, SIZE, SIZE, generator=g),
             allowed[torch.randint(len(allowed), (BATCH,), generator=g)]) for _ in range(n)]


def _data(cid: int, batches: list[tuple[Tensor, Tensor]], epochs: int = EPOCHS, sgd: dict | None = None) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    settings = TrainSettings(local_epochs=epochs, batch_size=BATCH, optimizer=dict(sgd or SGD))
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid),
                      settings=settings)


def _ours(cls: type[Method], **params: Any) -> Method:
    """Our method on ``resnet8_pft`` (a seeded random draw) with a CLASSES-way head."""
    torch.manual_seed(0)
    return cls(prompt_adapter(build_backbone(ARCH)), CLASSES, params)


def _fit(method: Method, cid: int, state: dict, downlink: dict, data: ClientData) -> tuple[dict, FitResult]:
    """Our client's round, its model in train mode as the engine leaves it."""
    method.model_for(cid).train()
    return method.client.fit(cid, state, downlink, data, data.settings)


def their_key(key: str) -> str:
    """Fling's ResNet name of one of our state keys (net.conv1 = pre_conv, net.bn1 = pre_bn, net.layer<i> =
    layers.<i-1>, head = fc, FedRoD: head = fc.fedrod_g_head, phead = fc.fedrod_p_head)."""
    for ours, theirs in (("net.conv1.", "pre_conv."), ("net.bn1.", "pre_bn."), ("phead.", "fc.fedrod_p_head.")):
        if key.startswith(ours):
            return theirs + key[len(ours):]
    if m := re.fullmatch(r"net\.layer(\d+)\.(.*)", key):
        return f"layers.{int(m[1]) - 1}.{m[2]}"
    if key.startswith("head."):
        return "fc." + key[5:]
    raise KeyError(key)


def _their_name(key: str, rod: bool) -> str:
    """``their_key`` with FedRoD's generic head inside ``fc``."""
    return "fc.fedrod_g_head." + key[5:] if rod and key.startswith("head.") else their_key(key)


def _as_ours(theirs: dict[str, Tensor] | nn.Module, keys: list[str], rod: bool = False) -> dict[str, Tensor]:
    """Their state dict (or model's) under our names, copies."""
    sd = theirs.state_dict() if isinstance(theirs, nn.Module) else theirs
    return {k: sd[_their_name(k, rod)].detach().clone() for k in keys if _their_name(k, rod) in sd}


def _adopt(model: nn.Module, ours: dict[str, Tensor], rod: bool = False) -> None:
    """Our tensors into their model (once compared): the next stage starts bit-identical on both sides."""
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in ours.items():
            if k != COUNTS:
                sd[_their_name(k, rod)].copy_(v)


def _floats(keys: list[str]) -> list[str]:
    """The keys without BatchNorm's batch counters (integers, compared apart)."""
    return [k for k in keys if not k.endswith(NBT)]


def _config(n: int, group: dict | None = None, model: dict | None = None, **learn: Any) -> Config:
    """The ``args`` their clients, groups and ``get_model`` read. ``launcher`` is not ``serial``: there
    ``get_model`` would ``torch.compile`` the model."""
    return Config(
        learn={"device": "cpu", "local_eps": EPOCHS, "batch_size": BATCH, "optimizer": dict(SGD), **learn},
        model={"name": "resnet8", "input_channel": 3, "class_number": CLASSES, **(model or {})},
        client={"client_num": n, "val_frac": 0, "sample_rate": 1},
        group={"aggregation_method": "avg", "aggregation_parameters": {"name": "all"}, "include_non_param": True,
               **(group or {})},
        launcher={"name": "compare"}, other={"resume_path": None})


def _samples(batches: list[tuple[Tensor, Tensor]]) -> list[dict[str, Tensor]]:
    """Their dataset items (``input``, ``class_id``), one per sample."""
    return [{"input": x[i], "class_id": y[i]} for x, y in batches for i in range(len(y))]


def _loader(batches: list[tuple[Tensor, Tensor]]) -> list[dict[str, Tensor]]:
    """Their data loader's batches, ours in our order."""
    return [{"input": x, "class_id": y} for x, y in batches]


def _their_clients(cls: type, cfg: Config, method: Method, data: dict[int, list], test: list,
                   rod: bool = False) -> list:
    """Their client ``cls`` per client, its model holding our initial model, its loaders our batches; built under
    a forked torch generator (their ``get_model`` draws a model) and restoring the float32 matmul precision their
    ``get_model`` sets."""
    clients, precision = [], torch.get_float32_matmul_precision()
    with torch.random.fork_rng(devices=[]):
        for c, batches in data.items():
            client = cls(args=cfg, client_id=c, train_dataset=_samples(batches), test_dataset=_samples(test))
            client.train_dataloader, client.test_dataloader = _loader(batches), _loader(test)
            _adopt(client.model, method.initial_state(c, method.keys(c)), rod)
            clients.append(client)
    torch.set_float32_matmul_precision(precision)
    return clients


def _their_group(fling: SimpleNamespace, cls: type, cfg: Config, clients: list) -> Any:
    """Their group ``cls`` with ``clients`` and a server, initialised (``fed_keys``; every client synced to the
    global model, client 0's, i.e. our initial model)."""
    group = cls(cfg, Quiet())
    group.server = fling.server.ServerTemplate(cfg, None)
    for client in clients:
        group.append(client)
    group.initialize()
    return group


def _scores(method: Method, model: nn.Module, test: list) -> Tensor:
    """Our evaluator's logits on the test batches (model loaded, eval mode)."""
    model.eval()
    return torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {})) for x, y in test])


def _check_test(client: Any, logits: Tensor, test: list, what: str, personal_logits: bool = True) -> None:
    """Their ``client.test()`` (accuracy and CE, batch-weighted means) equals ours from our logits; and their
    model's logits on the same batches equal ours (FedRoD: their p-head output)."""
    labels = torch.cat([y for _, y in test])
    result = client.test()
    assert result["test_acc"] == pytest.approx(float((logits.argmax(1) == labels).float().mean()), abs=1e-9)
    assert result["test_loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-5)
    with torch.no_grad():
        out = client.model.eval()(torch.cat([x for x, _ in test]))
    _close({"logits": logits}, {"logits": out[1] if isinstance(out, tuple) else out}, what)


# ---- FedCAC ---------------------------------------------------------------------------------------------------
class TorchRecordingTensor:
    """``torch`` for their fedcac_group module: records the overlap matrix ``torch.tensor(overlap_buffer)`` gets."""

    def __init__(self) -> None:
        self.overlaps: list[list[list[float]]] = []

    def tensor(self, data: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Record ``data`` (rows of 0-d tensors), then torch's."""
        self.overlaps.append([[float(v) for v in row] for row in data])
        return torch.tensor(data, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Everything else: torch's."""
        return getattr(torch, name)


TAU, BETA = 0.5, 3   # Fling's CIFAR-10 τ; β small so that t/β (1/3, 2/3) moves the threshold between the rounds


def test_fedcac_update_critical_sets_overlaps_customised_and_global_models_start_and_evaluation(fling, monkeypatch):
    """FedCAC (fedcac_client.py, fedcac_group.py), 3 clients of unequal data, 2 rounds: the local update, the
    critical masks (τ), the overlap rates, the sample-weighted global model, the customised models (collaborators
    by the (t/β) threshold), the mixed model each client starts from / is scored with (their ``sync``, own BatchNorm
    statistics), and the evaluation."""
    method = _ours(FedCAC, tau=TAU, beta=BETA)
    data = {0: _batches(3, 10, missing=(4,)), 1: _batches(2, 11), 2: _batches(4, 12, missing=(0, 1))}
    test = _batches(2, 99)
    cfg = _config(3, tau=TAU, beta=BETA)
    recorder = TorchRecordingTensor()
    monkeypatch.setattr(fling.cac_group, "torch", recorder)
    clients = _their_clients(fling.cac.FedCACClient, cfg, method, data, test)
    group = _their_group(fling, fling.cac_group.FedCACServerGroup, cfg, clients)
    keys, params = method.keys(0), method.trainable_keys(0)
    buffers = [k for k in keys if k not in params]
    state, states = method.strategy.init_state(3), {c: method.client.init_state(c) for c in data}
    sizes = []
    for r in (1, 2):
        results = []
        for c, client in enumerate(clients):
            client.train(lr=LR)
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            _close(module_state(method.model_for(c), _floats(keys)), _as_ours(client.model, _floats(keys)),
                   f"FedCAC round {r} client {c} model")
            ours_masks = method.split_mask(c, res.uplink["critical"])
            for k, local, glob in zip(params, client.local_mask, client.global_mask, strict=True):
                assert torch.equal(ours_masks[k], local.bool()), f"round {r} client {c} critical mask of {k}"
                assert torch.equal(glob.bool(), ~local.bool())
            assert torch.equal(res.uplink["critical"], client.critical_parameter.bool())
            assert set(res.uplink["model"]) == set(params)           # parameters only are uploaded (documented)
            _adopt(client.model, module_state(method.model_for(c), keys))
        state = method.strategy.aggregate(RoundInfo(r, 3, 1.0, 0), state, results)
        group.aggregate(r - 1)
        _close(state["model"], _as_ours(group.server.glob_dict, params), f"FedCAC round {r} global model", params)
        # overlap rates: theirs per pair in float32 (row i: j ≠ i in order), ours float64 (documented)
        rates = overlap_rates([results[c].uplink["critical"] for c in range(3)])
        theirs = recorder.overlaps[-1]
        for i in range(3):
            others = [j for j in range(3) if j != i]
            assert theirs[i] == pytest.approx([float(rates[i, j]) for j in others], abs=1e-6)
        sizes.append([len(g) for g in state["collaborators"].values()])
        for c, client in enumerate(clients):
            down = method.strategy.configure(state, c)
            _close(down["customized"], _as_ours(client.customized_model, params),
                   f"FedCAC round {r} client {c} customised model")
            model = method.model_for(c)
            method.evaluator.load(model, c, state, states[c], None)
            ours = module_state(model, keys)
            # their sync mixes parameters only: each client keeps its own BatchNorm statistics (documented)
            _close(ours, _as_ours(client.model, keys), f"FedCAC round {r} client {c} mixed start", _floats(keys))
            assert all(torch.equal(ours[k], states[c]["model"][k]) for k in buffers)
            _check_test(client, _scores(method, model, test), test, f"FedCAC round {r} client {c} logits")
            _adopt(client.model, ours)
    # the threshold mattered: some client collaborated with another, and not every pair did
    assert any(s > 1 for round_sizes in sizes for s in round_sizes), sizes
    assert any(s < 3 for round_sizes in sizes for s in round_sizes), sizes
    print("FedCAC collaborator group sizes per round:", sizes)


def test_fedcac_collaborators_over_the_rounds_equal_flings(fling, monkeypatch):
    """The collaboration rule alone, on designed critical sets of 4 clients whose overlap rates spread (≈ 0.95,
    0.90, 0.86, 0.80, 0.77, 0.74): for every t < β their ``get_customized_global_models`` (threshold mean +
    (t/β)(max − mean), their ``epoch`` = t − 1) picks the same collaborators as ours (the customised models, plain
    means of the clients' distinct models, equal), and the sets change with t, so an offset in t shows."""
    beta, n = 10, 4
    cfg = _config(n, tau=TAU, beta=beta)
    method = _ours(FedCAC, tau=TAU, beta=beta)
    data = {c: _batches(1, 70 + c) for c in range(n)}
    clients = _their_clients(fling.cac.FedCACClient, cfg, method, data, data[0])
    with torch.random.fork_rng(devices=[]):   # distinct models (their own draws), so that each set has its mean
        torch.manual_seed(3)
        for client in clients:
            client.model = fling.resnet.resnet8(input_channel=3, class_number=CLASSES)
    group = fling.cac_group.FedCACServerGroup(cfg, Quiet())
    for client in clients:
        group.append(client)
    params = method.trainable_keys(0)
    g = torch.Generator().manual_seed(0)
    base = torch.rand(20_000, generator=g) < 0.5
    masks = [base] + [base ^ (torch.rand(base.numel(), generator=g) < f) for f in (0.05, 0.2, 0.1)]
    for client, m in zip(clients, masks):
        client.critical_parameter = m.int()
    rates = overlap_rates(masks)
    seen = set()
    for t in range(1, beta):
        group.epoch = t - 1
        group.get_customized_global_models()
        sets = collaborators(rates, t, beta)
        seen.add(tuple(map(tuple, sets)))
        for i, client in enumerate(clients):
            expected = customised_model([_as_ours(clients[j].model, params) for j in sets[i]])
            _close(expected, _as_ours(client.customized_model, params), f"FedCAC t={t} client {i} customised model")
    assert len(seen) >= 3, seen


# ---- pFedSD ---------------------------------------------------------------------------------------------------
def test_pfedsd_self_distillation_update_average_and_personalised_evaluation(fling):
    """pFedSD (pfedsd_client.py; base_group, every state key averaged by sample count): round 1 CE only, round 2
    CE + λ·T²·KL to the previous personalised model (a train-mode copy); the personalised model (the trained one)
    is what each client is scored with (Fling's ``before_aggregation`` test)."""
    lam, temp = 0.5, 3.0
    method = _ours(PFedSD, lam=lam, temperature=temp)
    data = {0: _batches(3, 20, missing=(2,)), 1: _batches(2, 21)}
    test = _batches(2, 98)
    cfg = _config(2, lamda=lam, tau=temp)
    clients = _their_clients(fling.sd.pFedSDClient, cfg, method, data, test)
    group = _their_group(fling, fling.base_group.ParameterServerGroup, cfg, clients)
    keys = method.keys(0)
    state, states = method.strategy.init_state(len(data)), {c: method.client.init_state(c) for c in data}
    for r in (1, 2):
        results = []
        for c, client in enumerate(clients):
            assert (client.local_model_pre is None) == (r == 1)
            client.train(lr=LR)
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            _close(res.uplink["model"], _as_ours(client.model, keys), f"pFedSD round {r} client {c} model",
                   _floats(keys))
            _close(states[c]["model"], _as_ours(client.local_model_pre, keys),
                   f"pFedSD round {r} client {c} personalised model", _floats(keys))
            model = method.model_for(c)
            method.evaluator.load(model, c, state, states[c], None)
            _check_test(client, _scores(method, model, test), test, f"pFedSD round {r} client {c} logits")
            _adopt(client.model, states[c]["model"])
            _adopt(client.local_model_pre, states[c]["model"])
        state = method.strategy.aggregate(RoundInfo(r, len(data), 1.0, 0), state, results)
        group.aggregate(r - 1)
        _check_average(state["model"], group.server.glob_dict, results, keys, f"pFedSD round {r} average")
        for client in clients:
            _adopt(client.model, state["model"])


def _check_average(ours: dict[str, Tensor], glob: dict[str, Tensor], results: list[FitResult], keys: list[str],
                   what: str, rod: bool = False) -> None:
    """Our server average equals their ``fed_avg``'s ``glob_dict`` on every float key. The batch counters:
    UNDOCUMENTED, harmless: theirs truncates the weighted mean (a float loaded into an int64 buffer), ours rounds
    it; BatchNorm with momentum never reads them."""
    shared = [k for k in keys if k in ours]
    _close(ours, _as_ours(glob, shared, rod), what, _floats(shared))
    weights = [r.num_samples / sum(q.num_samples for q in results) for r in results]
    for k in shared:
        if k.endswith(NBT):
            mean = sum(w * float(r.uplink["model"][k]) for w, r in zip(weights, results))
            assert int(ours[k]) == round(mean) and int(glob[_their_name(k, rod)].long()) == int(mean)


# ---- FedAvg, FedPer, FedBN: Fling's base client and group with their flzoo aggregation keys --------------------
SPLITS = {"fedavg": (FedAvg, {"name": "all"}),
          "fedper": (FedPer, {"name": "except", "keywords": ["fc"]}),
          "fedbn": (FedBN, {"name": "except", "keywords": ["bn", "downsample.1"]})}


@pytest.mark.parametrize("name", list(SPLITS))
def test_base_client_update_fed_keys_average_and_what_each_client_keeps(fling, name):
    """FedAvg / FedPer / FedBN as Fling's ``base_client`` + ``base_group`` with the flzoo ``aggregation_parameters``
    (all; all but ``fc``; all but ``bn``/``downsample.1``, state keys included): the local update, the shared keys
    (their ``fed_keys`` = our uplink), the sample-weighted average, and the model each client holds after ``sync``
    (= our evaluator's / next start) over 2 rounds."""
    cls, rule = SPLITS[name]
    method = _ours(cls)
    data = {0: _batches(3, 30, missing=(1,)), 1: _batches(2, 31, missing=(3, 4))}
    test = _batches(1, 97)
    cfg = _config(2, group={"aggregation_parameters": rule})
    clients = _their_clients(fling.base_client.BaseClient, cfg, method, data, test)
    group = _their_group(fling, fling.base_group.ParameterServerGroup, cfg, clients)
    keys = method.keys(0)
    shared = method.client.shared_keys(keys)
    assert sorted(their_key(k) for k in shared) == sorted(clients[0].fed_keys)   # the same split, by name there
    state, states = method.strategy.init_state(len(data)), {c: method.client.init_state(c) for c in data}
    for r in (1, 2):
        results = []
        for c, client in enumerate(clients):
            client.train(lr=LR)
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            trained = module_state(method.model_for(c), keys)
            _close(trained, _as_ours(client.model, keys), f"{name} round {r} client {c} model", _floats(keys))
            assert set(res.uplink["model"]) == set(shared)
            _adopt(client.model, trained)
        state = method.strategy.aggregate(RoundInfo(r, len(data), 1.0, 0), state, results)
        group.aggregate(r - 1)
        _check_average(state["model"], group.server.glob_dict, results, keys, f"{name} round {r} average")
        for c, client in enumerate(clients):
            model = method.model_for(c)
            method.evaluator.load(model, c if method.evaluator.personalized else None, state, states[c], None)
            ours = module_state(model, keys)
            _close(ours, _as_ours(client.model, keys), f"{name} round {r} client {c} after sync", _floats(keys))
            if method.evaluator.personalized:
                _check_test(client, _scores(method, model, test), test, f"{name} round {r} client {c} logits")
            _adopt(client.model, ours)


# ---- FedRoD ---------------------------------------------------------------------------------------------------
def test_fedrod_fling_variant_update_counts_average_and_personalised_prediction(fling):
    """FedRoD (fedrod_client.py, ResNet ``fedrod_head``; base_group over every key but ``fedrod_p_head``) against
    ours with ``detach_personal: false`` (documented: Fling's personal CE reaches the body): the update (body,
    generic head by balanced softmax, personal head), the label counts, the average, and the prediction
    g.detach() + h_P with the global body and own h_P; 2 rounds. Their separately drawn h_P (documented) is set to
    ours (a copy of the generic head's initial weights)."""
    method = _ours(FedRoD, detach_personal=False)
    data = {0: _batches(3, 40, missing=(4,)), 1: _batches(2, 41, missing=(0, 2))}
    test = _batches(2, 96)
    cfg = _config(2, group={"aggregation_parameters": {"name": "except", "keywords": ["fedrod_p_head"]}},
                  model={"fedrod_head": True})
    clients = _their_clients(fling.rod.FedRoDClient, cfg, method, data, test, rod=True)
    group = _their_group(fling, fling.base_group.ParameterServerGroup, cfg, clients)
    keys = [k for k in method.keys(0) if k != COUNTS]
    shared = method.client.shared_keys(keys)
    assert sorted(_their_name(k, True) for k in shared) == sorted(clients[0].fed_keys)
    state, states = method.strategy.init_state(len(data)), {c: method.client.init_state(c) for c in data}
    for r in (1, 2):
        results = []
        for c, client in enumerate(clients):
            client.train(lr=LR)
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            trained = module_state(method.model_for(c), keys)
            _close(trained, _as_ours(client.model, keys, rod=True), f"FedRoD round {r} client {c} model",
                   _floats(keys))
            assert states[c]["model"][COUNTS].tolist() == client.spc.float().tolist()
            _adopt(client.model, trained, rod=True)
        state = method.strategy.aggregate(RoundInfo(r, len(data), 1.0, 0), state, results)
        group.aggregate(r - 1)
        _check_average(state["model"], group.server.glob_dict, results, keys, f"FedRoD round {r} average", rod=True)
        for c, client in enumerate(clients):
            model = method.model_for(c)
            method.evaluator.load(model, c, state, states[c], None)
            ours = module_state(model, keys)
            _close(ours, _as_ours(client.model, keys, rod=True), f"FedRoD round {r} client {c} after sync",
                   _floats(keys))
            _check_test(client, _scores(method, model, test), test, f"FedRoD round {r} client {c} p-logits")
            _adopt(client.model, ours, rod=True)


# ---- FedProx --------------------------------------------------------------------------------------------------
def test_fedprox_proximal_term_is_a_sum_of_unsquared_norms_in_fling(fling):
    """FedProx (fedprox_client.py): Fling adds μ·Σ_k ‖w_k − w_g,k‖₂ (per-tensor L2 norms, not squared, not
    halved; torch_utils.get_model_difference), ours the FedProx paper's (μ/2)·‖w − w_g‖² (documented). From the
    same start the first step is equal (both gradients 0 at w = w_g); the second step, from equal tensors and
    momentum buffers, differs by exactly −lr·μ·(Δ_k − Δ_k/‖Δ_k‖) per tensor, Δ = w − w_g after step 1. The
    server is Fling's base_group (FedAvg, checked above)."""
    mu = 0.5
    method = _ours(FedProx, mu=mu)
    batches = _batches(2, 50, missing=(3,))
    cfg = _config(1, mu=mu, local_eps=1)
    keys, params = method.keys(0), method.trainable_keys(0)
    down = method.strategy.configure(method.strategy.init_state(1), 0)
    x = {k: v.clone() for k, v in down["model"].items()}

    def both(steps: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        (client,) = _their_clients(fling.prox.FedProxClient, cfg, method, {0: batches[:steps]}, batches)
        client.train(lr=LR)
        _fit(method, 0, {}, down, _data(0, batches[:steps], epochs=1))
        return module_state(method.model_for(0), keys), _as_ours(client.model, keys)

    ours1, theirs1 = both(1)
    _close(ours1, theirs1, "FedProx step 1", _floats(keys))
    ours2, theirs2 = both(2)
    delta = {k: ours1[k] - x[k] for k in params}
    expected = {k: -LR * mu * (d - d / d.norm()) if bool(d.any()) else d for k, d in delta.items()}
    _close({k: ours2[k] - theirs2[k] for k in params}, expected, "FedProx step 2, ours − Fling's")
    assert max(float(v.abs().max()) for v in expected.values()) > 1e-4   # the difference is not rounding here


# ---- SCAFFOLD -------------------------------------------------------------------------------------------------
def test_scaffold_corrected_steps_control_variates_and_server_step(fling):
    """SCAFFOLD (scaffold_client.py, scaffold_group.py), 3 clients of equal size, 2 rounds (c, c_i nonzero in
    round 2): Δy, Δc, c_i and the server's x, c and BatchNorm statistics. Fling's steps are plain SGD at the lr
    ``train`` is given (ours ``plain_sgd: true``), K = local_eps·⌈n/B⌉. Fling weights Δy and the BatchNorm
    statistics by 1/|S|, ours by sample count (documented): equal here, and asserted on unequal weights."""
    method = _ours(Scaffold, server_lr=1.0, plain_sgd=True)
    data = {0: _batches(2, 60, missing=(3,)), 1: _batches(2, 61), 2: _batches(2, 62, missing=(0, 1))}
    cfg = _config(3, server_lr=1.0)
    clients = _their_clients(fling.scaffold.SCAFFOLDClient, cfg, method, data, _batches(1, 95))
    group = _their_group(fling, fling.scaffold_group.SCAFFOLDServerGroup, cfg, clients)
    keys, params = method.keys(0), method.trainable_keys(0)
    buffers = [k for k in keys if k not in params]
    state, states = method.strategy.init_state(3), {c: method.client.init_state(c) for c in data}
    for r in (1, 2):
        results = []
        for c, client in enumerate(clients):
            client.train(lr=LR)
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            assert res.stats["steps"] == EPOCHS * len(data[c])
            _close(res.uplink["delta"], _as_ours(client.delta_y, params), f"SCAFFOLD round {r} client {c} Δy")
            _close(res.uplink["delta_control"], _as_ours(client.delta_c, params), f"SCAFFOLD round {r} client {c} Δc")
            _close(states[c]["control"], _as_ours(client.c, params), f"SCAFFOLD round {r} client {c} c_i")
            _close(res.uplink["buffers"], _as_ours(client.model, buffers), f"SCAFFOLD round {r} client {c} buffers",
                   _floats(buffers))
        before = state
        state = method.strategy.aggregate(RoundInfo(r, 3, 1.0, 0), state, results)
        group.aggregate(r - 1)
        _close(state["model"], _as_ours(group.server.glob_dict, keys), f"SCAFFOLD round {r} server x and statistics",
               _floats(keys))
        _close(state["control"], _as_ours(group.server.c, params), f"SCAFFOLD round {r} server c")
        with torch.no_grad():   # round 2 from equal x, c, c_i (see _adopt)
            for k in keys:
                group.server.glob_dict[their_key(k)].copy_(state["model"][k])
            for k in params:
                group.server.c[their_key(k)].copy_(state["control"][k])
                for c, client in enumerate(clients):
                    client.c[their_key(k)].copy_(states[c]["control"][k])
        for client in clients:
            _adopt(client.model, state["model"])
    assert max(float(v.abs().max()) for v in state["control"].values()) > 1e-2   # c matters in round 2

    # documented: Δy (and the statistics) weighted by sample count (ours) vs 1/|S| (Fling, the uniform mean above)
    sizes = [40, 16, 8]
    weighted = method.strategy.aggregate(RoundInfo(2, 3, 1.0, 0), before,
                                         [FitResult(r.cid, n, r.uplink, r.stats) for r, n in zip(results, sizes)])
    for k in params:
        step = sum(n / sum(sizes) * r.uplink["delta"][k].double() for r, n in zip(results, sizes))
        torch.testing.assert_close(weighted["model"][k].double(), before["model"][k].double() + step,
                                   rtol=1e-5, atol=1e-6)
    assert not torch.allclose(weighted["model"][params[0]], state["model"][params[0]], rtol=1e-5, atol=1e-6)


# ---- the architectures ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ours_arch", "theirs", "classes", "size", "trunk"),
                         [("resnet8_pft", "resnet8", 10, 32, 1_232_704),
                          ("resnet10_pft", "resnet10", 100, 32, 4_905_792),
                          ("resnet10_pft", "resnet10", 200, 64, 4_905_792)])
def test_resnet8_and_resnet10_equal_flings(fling, ours_arch, theirs, classes, size, trunk):
    """Our FedPFT extractors + linear head are Fling's ``resnet8`` / ``resnet10`` (flzoo: ResNet-8 for CIFAR-10,
    ResNet-10 for CIFAR-100; Tiny at 64 px): the same tensors under the name map (shapes, order), the same
    parameter counts (trunk = FedPFT Table 10's 1.24 M / 4.91 M with buffers), and with their weights loaded into
    ours the same logits in train and eval mode."""
    torch.manual_seed(0)
    method = FedAvg(prompt_adapter(build_backbone(ours_arch)), classes, {})
    ours = method.model
    assert isinstance(ours.net, StemResNet)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = getattr(fling.resnet, theirs)(input_channel=3, class_number=classes)
    sd = model.state_dict()
    assert [their_key(k) for k in ours.state_dict()] == list(sd)
    assert all(ours.state_dict()[k].shape == sd[their_key(k)].shape for k in ours.state_dict())
    n_ours = sum(p.numel() for p in ours.net.parameters())
    n_theirs = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("fc."))
    assert n_ours == n_theirs == trunk
    ours.load_state_dict({k: sd[their_key(k)] for k in ours.state_dict()})
    x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(5))
    for train in (True, False):
        ours.train(train), model.train(train)
        with torch.no_grad():
            mode = "train" if train else "eval"
            _close({"logits": ours(x)}, {"logits": model(x)}, f"{ours_arch} vs Fling {theirs} ({mode})")
