"""Our FedBN against the ORIGINAL authors' code (github.com/med-air/FedBN, HEAD 2fa38ad), number for number.

Their ``federated/fed_digits.py`` and ``federated/fed_office.py`` (``train``, ``communication``, ``test``) and
``nets/models.py`` (``DigitModel``, ``AlexNet``) are imported at test time from the checkout named by
``FEDPROMPT_FEDBN_OFFICIAL`` (``git archive HEAD`` of med-air/FedBN); nothing of it is copied here. Without the
variable every test skips (CI has no checkout and no internet). Nothing is stood in: their modules import only
torch, torchvision, numpy and PIL at module level (the data sets are read in ``prepare_data``, never called here).

Their scripts' ``__main__`` is the harness, driven here call for call as it runs: every round a fresh
``optim.SGD(params, lr)`` per client (fed_digits.py:282), ``wk_iters`` epochs of their ``train`` per client, then
``communication(args, server_model, models, client_weights)`` with ``args.mode = "fedbn"`` (their module global
``client_num`` set, which ``communication`` reads at fed_digits.py:171), then their ``test`` of each client's own
model. Both sides get the same model (our ``resnet8_pft_mini`` + linear head; their side holds deep copies of it,
as their harness deep-copies ``server_model`` into every client, fed_digits.py:248: their ``train``, ``test`` and
``communication`` are model-agnostic), the same batches in a fixed order (their loaders replaced by ours), plain
SGD (their optimiser: no momentum, no weight decay), fp32 on the CPU, 3 clients of unequal data, 2 rounds, each
stage from bit-identical inputs (their models adopt ours once compared, as tests/test_official_pfllib.py ``_adopt``).

Compared: every tensor of each client's local update (parameters and BatchNorm statistics) and its mean training
loss, what is uploaded (their ``communication`` reads every key without ``bn`` in its name), the server's average,
what each client holds after the round (global shared part + own BatchNorm layers: what it is scored with and
starts the next round from), and the evaluation (logits, their ``test``'s loss and accuracy).

Differences, asserted as what they are (DEVIATIONS.md, FedBN; fedcore/methods/fedbn.py docstring):
* which tensors stay local: theirs every state key whose NAME contains ``bn`` (fed_digits.py:169, the same in
  fed_office.py and fed_domainnet.py:101), buffers included. On their own ``DigitModel`` and ``AlexNet`` every
  BatchNorm is named ``bn<i>``, so that is exactly ours (every BatchNorm by module type: the paper's "local BN").
  On a ResNet the name rule would also average the ``downsample.1`` BatchNorm layers (all five keys; PFLlib's
  FedBN the same by name, but parameters only): ours keeps them local, as the paper and Fling do.
* the server's weights: their scripts pass 1/K (fed_digits.py:247; fed_office.py the same), ours the sample
  fraction n_k/n (FedAvg's, as FedPFT's "based on FedAvg", Fling and PFLlib). Their experiments truncate every
  client to the same size (fed_office.py ``min_data_len``; the Digits partitions), where the two are equal: shown
  here on clients of equal size; on unequal ones their average is the plain mean. The comparison over rounds passes
  n_k/n to their ``communication`` (it takes the weights as an argument).

Run: ``FEDPROMPT_FEDBN_OFFICIAL=/tmp/fedbn_official python -m pytest -n 0 tests/test_official_fedbn.py`` (``-s``
prints the largest differences found).
"""
from __future__ import annotations

import copy
import functools
import importlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn, optim
from torch.nn import functional as F

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, Method, RoundInfo, module_state
from fedcore.methods.fedbn import FedBN, batchnorm_keys
from fedcore.official_code import checkout_on_path
from official_support import assert_state_close as _close
from official_support import random_batches

ENV = "FEDPROMPT_FEDBN_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a checkout of the "
                                "original FedBN code (github.com/med-air/FedBN) to compare our FedBN against")

ARCH, CLASSES, BATCH, SIZE, LR, EPOCHS = "resnet8_pft_mini", 5, 8, 16, 0.05, 2
SGD = {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0}   # their optim.SGD(params, lr)
NBT = "num_batches_tracked"
THEIR_PACKAGES = ("federated", "nets", "utils")
SCRIPTS = ("fed_digits", "fed_office")
DOWNSAMPLE_BN = [f"net.layer{i}.0.downsample.1.{k}" for i in (2, 3)
                 for k in ("weight", "bias", "running_mean", "running_var", NBT)]


# ---- importing their code -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fedbn() -> SimpleNamespace:
    """Their two federated scripts and their models module."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "federated" / "fed_digits.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of med-air/FedBN (no federated/fed_digits.py)")
    for name in ("torchvision", "torchvision.transforms"):   # their scripts import it; loaded once, outside
        importlib.import_module(name)
    with checkout_on_path(root, THEIR_PACKAGES):   # their modules append their root to sys.path: restored on exit
        mods = {s: importlib.import_module(f"federated.{s}") for s in SCRIPTS}
        mods["models"] = importlib.import_module("nets.models")
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return SimpleNamespace(**mods)


# ---- the shared setting ---------------------------------------------------------------------------------------
class Loader:
    """Their ``DataLoader`` over our fixed batches: ``len`` (batches) on the loader and on its iterator (fed_digits'
    ``train`` counts ``len(iter(loader))``), and ``dataset`` of the sample count (its ``test`` divides by it)."""

    def __init__(self, batches: list[tuple[Tensor, Tensor]]) -> None:
        self.batches = batches
        self.dataset = range(sum(len(y) for _, y in batches))

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> "_Iter":
        return _Iter(self.batches)


class _Iter:
    """An iterator over a list that also has a length."""

    def __init__(self, items: list) -> None:
        self.items, self.i = items, 0

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> "_Iter":
        return self

    def __next__(self) -> Any:
        if self.i == len(self.items):
            raise StopIteration
        self.i += 1
        return self.items[self.i - 1]


# ``n`` batches of BATCH random images (3 x SIZE x SIZE), labels from the classes not in ``missing``
_batches = functools.partial(random_batches, batch=BATCH, classes=CLASSES, size=SIZE)


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    settings = TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=dict(SGD))
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid),
                      settings=settings)


def _ours() -> Method:
    """Our FedBN on ``resnet8_pft_mini`` (a seeded random draw) with a CLASSES-way head."""
    torch.manual_seed(0)
    return FedBN(prompt_adapter(build_backbone(ARCH)), CLASSES, {})


def _fit(method: Method, cid: int, state: dict, downlink: dict, data: ClientData) -> tuple[dict, FitResult]:
    """Our client's round, its model in train mode as the engine leaves it."""
    method.model_for(cid).train()
    return method.client.fit(cid, state, downlink, data, data.settings)


def _state(model: nn.Module) -> dict[str, Tensor]:
    """Copies of their model's state tensors (their optimisers and ``communication`` write in place)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _adopt(model: nn.Module, ours: dict[str, Tensor]) -> None:
    """Our tensors into their model, once compared: the next stage starts bit-identical on both sides."""
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in ours.items():
            sd[k].copy_(v)


def _floats(keys: list[str]) -> list[str]:
    """The keys without BatchNorm's batch counters (integers, compared exactly apart)."""
    return [k for k in keys if not k.endswith(NBT)]


def _their_train(mod: Any, model: nn.Module, batches: list, optimizer: optim.Optimizer) -> float:
    """One epoch of their ``train`` (fed_digits' takes ``client_num``, unused; fed_office's does not); its mean
    batch loss."""
    loss_fun = nn.CrossEntropyLoss()
    if mod.__name__.endswith("fed_digits"):
        loss, _ = mod.train(model, Loader(batches), optimizer, loss_fun, 0, "cpu")
    else:
        loss, _ = mod.train(model, Loader(batches), optimizer, loss_fun, "cpu")
    return loss


def _communicate(mod: Any, monkeypatch: pytest.MonkeyPatch, server: nn.Module, models: list[nn.Module],
                 weights: list[float]) -> None:
    """Their ``communication`` in FedBN mode; it reads the module global ``client_num`` that their ``__main__``
    defines (fed_digits.py:171, 246)."""
    monkeypatch.setattr(mod, "client_num", len(models), raising=False)
    mod.communication(SimpleNamespace(mode="fedbn"), server, models, weights)


# ---- which tensors stay local ---------------------------------------------------------------------------------
def test_their_name_rule_is_every_batchnorm_on_their_models_and_misses_downsample_on_resnets(fedbn):
    """Their rule (a state key stays local iff ``bn`` is in its name, fed_digits.py:169) equals ours (every
    BatchNorm by module type) on their ``DigitModel`` and ``AlexNet``; on our ResNets it misses exactly the five
    keys of each ``downsample.1`` BatchNorm, which ours keeps local (documented)."""
    for build in (fedbn.models.DigitModel, fedbn.models.AlexNet):
        with torch.device("meta"):   # names only: AlexNet's 57 M parameters are never allocated
            model = build()
        keys = list(model.state_dict())
        theirs = {k for k in keys if "bn" in k}
        assert theirs == batchnorm_keys(model), build.__name__
        assert len(theirs) == 5 * sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    method = _ours()
    keys = method.keys(0)
    local = set(method.client.personal_keys(keys))
    assert local == batchnorm_keys(method.model_for(0))
    assert sorted(local - {k for k in keys if "bn" in k}) == sorted(DOWNSAMPLE_BN)
    assert {k for k in keys if "bn" in k} <= local


# ---- the rounds -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS)
def test_local_update_upload_server_step_and_personal_evaluation(fedbn, script, monkeypatch):
    """Their ``__main__`` loop (fresh SGD, E epochs of ``train``, ``communication``, ``test`` of each client's own
    model) against our roles, 3 clients of unequal data, 2 rounds, the sample weights passed to theirs."""
    mod = getattr(fedbn, script)
    method = _ours()
    data = {0: _batches(3, 20, missing=(4,)), 1: _batches(2, 21, missing=(0, 1)), 2: _batches(4, 22)}
    tests = {c: _batches(2, 90 + c) for c in data}
    n = len(data)
    keys = method.keys(0)
    local = set(method.client.personal_keys(keys))
    shared = method.client.shared_keys(keys)
    server_model = copy.deepcopy(method.model_for(0))   # our initial model (nothing trained yet)
    models = [copy.deepcopy(server_model) for _ in data]   # fed_digits.py:248
    initial = _state(server_model)
    state, states = method.strategy.init_state(n), {c: method.client.init_state(c) for c in data}
    sizes = [sum(len(y) for _, y in data[c]) for c in data]
    weights = [s / sum(sizes) for s in sizes]
    for r in (1, 2):
        optimizers = [optim.SGD(params=models[c].parameters(), lr=LR) for c in data]   # fed_digits.py:282
        losses = {c: [] for c in data}
        for _ in range(EPOCHS):
            for c in data:
                models[c].train()
                losses[c].append(_their_train(mod, models[c], data[c], optimizers[c]))
        results, trained = [], []
        for c in data:
            states[c], res = _fit(method, c, states[c], method.strategy.configure(state, c), _data(c, data[c]))
            results.append(res)
            ours = module_state(method.model_for(c), keys)
            theirs = _state(models[c])
            _close(ours, theirs, f"{script} round {r} client {c} local update", _floats(keys))
            assert all(torch.equal(ours[k], theirs[k]) for k in keys if k.endswith(NBT))
            # equal batch sizes: our sample-weighted mean over the steps = the mean of their epochs' batch means
            assert res.stats["loss"] == pytest.approx(sum(losses[c]) / EPOCHS, rel=1e-5)
            # the upload: ours every non-BatchNorm key; their communication reads every key without "bn"
            assert set(res.uplink["model"]) == set(shared)
            assert {k for k in keys if "bn" not in k} == set(shared) | set(DOWNSAMPLE_BN)
            _close(res.uplink["model"], theirs, f"{script} round {r} client {c} upload")
            _close(states[c]["model"], theirs, f"{script} round {r} client {c} BatchNorm layers",
                   _floats(list(states[c]["model"])))
            assert set(states[c]["model"]) == local
            _adopt(models[c], ours)
            trained.append(ours)
        state = method.strategy.aggregate(RoundInfo(r, n, 1.0, 0), state, results)
        _communicate(mod, monkeypatch, server_model, models, weights)
        glob = _state(server_model)
        _close(state["model"], glob, f"{script} round {r} server average", shared)
        assert set(state["model"]) == set(shared)
        # their server's BatchNorm keys are never written in FedBN mode: the initial ones
        assert all(torch.equal(glob[k], initial[k]) for k in keys if "bn" in k)
        for c in data:
            model = method.model_for(c)
            method.evaluator.load(model, c, state, states[c], None)
            ours, theirs = module_state(model, keys), _state(models[c])
            same = [k for k in _floats(keys) if k not in DOWNSAMPLE_BN]
            _close(ours, theirs, f"{script} round {r} client {c} after communication", same)
            assert all(torch.equal(ours[k], trained[c][k]) for k in local)   # ours: every BatchNorm its own
            for k in _floats(DOWNSAMPLE_BN):   # theirs: downsample.1 averaged (documented), ours own
                mean = sum(w * t[k] for w, t in zip(weights, trained))
                torch.testing.assert_close(theirs[k], mean, rtol=1e-5, atol=1e-6)
                assert not torch.allclose(theirs[k], ours[k]), k
            _adopt(models[c], ours)
            model.eval()
            x, y = torch.cat([b[0] for b in tests[c]]), torch.cat([b[1] for b in tests[c]])
            logits = torch.cat([method.evaluator.predict(model, Batch(xb, yb, torch.arange(len(yb)), {}))
                                for xb, yb in tests[c]])
            with torch.no_grad():
                _close({"logits": logits}, {"logits": models[c].eval()(x)}, f"{script} round {r} client {c} logits")
            loss, acc = mod.test(models[c], Loader(tests[c]), nn.CrossEntropyLoss(), "cpu")
            assert acc == pytest.approx(float((logits.argmax(1) == y).float().mean()), abs=1e-12)
            assert loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)   # equal batch sizes


# ---- the server's weights -------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS)
def test_their_uniform_weights_equal_ours_on_equal_clients_and_are_the_plain_mean_otherwise(fedbn, script,
                                                                                          monkeypatch):
    """Their scripts' weights 1/K (fed_digits.py:247) against ours n_k/n (documented): equal on clients of equal
    size (their experiments); on unequal sizes theirs is the plain mean of the uploads."""
    mod = getattr(fedbn, script)
    method = _ours()
    keys = method.keys(0)
    shared = method.client.shared_keys(keys)
    base = copy.deepcopy(method.model_for(0))
    g = torch.Generator().manual_seed(5)
    uploads = [{k: base.state_dict()[k] + (torch.randn(base.state_dict()[k].shape, generator=g)
                                              if base.state_dict()[k].is_floating_point() else 0)
                for k in keys} for _ in range(3)]
    for sizes, equal in (((16, 16, 16), True), ((24, 8, 40), False)):
        models = [copy.deepcopy(base) for _ in sizes]
        for model, up in zip(models, uploads):
            _adopt(model, up)
        server = copy.deepcopy(base)
        _communicate(mod, monkeypatch, server, models, [1 / len(sizes)] * len(sizes))   # fed_digits.py:247
        results = [FitResult(c, s, {"model": {k: up[k] for k in shared}}, {}) for c, (s, up) in
                   enumerate(zip(sizes, uploads))]
        ours = method.strategy.aggregate(RoundInfo(1, 3, 1.0, 0), method.strategy.init_state(3), results)["model"]
        theirs = _state(server)
        floats = _floats(shared)
        if equal:
            _close(ours, theirs, f"{script} 1/K on equal clients", floats)
        else:
            plain = {k: sum(up[k] for up in uploads) / 3 for k in floats}
            _close(plain, theirs, f"{script} 1/K on unequal clients = the plain mean", floats)
            weighted = {k: sum(s * up[k] for s, up in zip(sizes, uploads)) / sum(sizes) for k in floats}
            _close(ours, weighted, "ours: n_k/n on unequal clients", floats)
            assert all(not torch.allclose(ours[k], theirs[k], rtol=1e-3, atol=1e-3) for k in floats)
