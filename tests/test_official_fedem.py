"""FedEM against the official code (github.com/omarfoq/FedEM, HEAD), number for number, on the CPU in fp32.

Opt-in: ``FEDPROMPT_FEDEM_OFFICIAL`` names a checkout of omarfoq/FedEM (``git archive HEAD``). Its ``client.py``
(``MixtureClient``), ``learners/`` (``Learner``, ``LearnersEnsemble``), ``aggregator.py``
(``CentralizedAggregator``) and ``utils/torch_utils.py`` (``average_learners``) are imported from there at test
time; nothing of it is copied here. CI has no checkout and no internet: every test skips there.

    FEDPROMPT_FEDEM_OFFICIAL=/tmp/fedem_official python -m pytest -n 0 tests/test_official_fedem.py

Both sides hold the SAME components: our FedEM on vit_mini (3 components, each a VPT-shallow prompt + linear head
on the one frozen backbone, stored stacked) is split into their 3 ``Learner`` models (``Component``: prompt m, head
m, the frozen backbone held outside the module's state so that their learner's parameter vector and their
averaging see only the component), with their optimiser (``utils/optim.py``: SGD, momentum 0.9, weight decay
5e-4) and their per-sample cross-entropy (``reduction="none"``). Their client iterates our fixed batches (the
train and the un-augmented ``val`` iterator: the same batches here). Compared over two rounds of two clients (of
unequal size): the E-step responsibilities q (``update_sample_weights``), the mixture weights π
(``update_learners_weights``), every component after the weighted M-step (``fit_epochs``), the server's
per-component average (``average_learners`` with their ``clients_weights``, as ``mix`` calls it) and each
client's mixture prediction (their ``evaluate_iterator``: NLL of log Σ_m π_m softmax). Each stage starts from
bit-identical tensors (their server adopts ours once compared). Documented differences (fedem.py docstring;
DEVIATIONS.md, FedEM) asserted as what they are: their learners keep their optimiser (momentum) across rounds, so
round 2 gives their learners fresh ones to compare, and the kept one is shown to differ; under partial
participation their ``mix`` averages over all clients (the unsampled ones holding the previous components), a
server step n_t/n of ours.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.machinery
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.prompted import PromptedViT, attention_backend
from fedcore.backbones.vit import build_vit
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import RoundInfo
from fedcore.methods.fedem import FedEM, component_losses, responsibilities
from fedcore.official_code import checkout_on_path

ENV = "FEDPROMPT_FEDEM_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a local checkout of "
                                "github.com/omarfoq/FedEM (none in CI, which has no internet)")

RTOL, ATOL = 1e-5, 1e-6                  # fp32 on the CPU
M, CLASSES, BATCH, EPOCHS = 3, 4, 8, 2
LR = 0.05
SGD = {"name": "sgd", "lr": LR, "momentum": 0.9, "weight_decay": 5e-4}   # their get_optimizer("sgd", ...)
SIZES = (24, 16)
VERBOSE = bool(os.environ.get("FEDPROMPT_VERBOSE"))   # every comparison's differences (with -s)
THEIR_PACKAGES = ("client", "aggregator", "learners", "utils", "sklearn")


# ---- importing the official code ---------------------------------------------------------------------------------
def _standins() -> dict[str, ModuleType]:
    """sklearn for aggregator.py's imports (its clustered aggregator's distances and clustering, never run here)."""
    mods = {n: ModuleType(n) for n in ("sklearn", "sklearn.metrics", "sklearn.cluster")}
    mods["sklearn.metrics"].pairwise_distances = mods["sklearn.cluster"].AgglomerativeClustering = None
    mods["sklearn"].metrics, mods["sklearn"].cluster = mods["sklearn.metrics"], mods["sklearn.cluster"]
    return mods


def _official_on_path(root: Path) -> contextlib.AbstractContextManager[None]:
    """Their checkout first on sys.path with the stand-ins (their generic top-level names must not leak
    into other tests)."""
    return checkout_on_path(root, THEIR_PACKAGES, _standins())


@pytest.fixture(scope="module")
def official() -> SimpleNamespace:
    """Their client, learner, ensemble, aggregator and torch_utils modules."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "learners" / "learners_ensemble.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of omarfoq/FedEM (no learners/learners_ensemble.py)")
    names = {"client": "client", "learner": "learners.learner", "ensemble": "learners.learners_ensemble",
             "aggregator": "aggregator", "torch_utils": "utils.torch_utils"}
    with _official_on_path(root), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # an invalid escape in a docstring of theirs
        mods = {k: importlib.import_module(v) for k, v in names.items()}
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return SimpleNamespace(**mods)


# ---- the shared model and data -----------------------------------------------------------------------------------
class Component(nn.Module):
    """One of our components as their learner's model: prompt m (n, D) and head m on the shared frozen backbone,
    which is kept out of this module's parameters and state (their learner flattens and averages all of them)."""

    def __init__(self, method: FedEM, m: int) -> None:
        super().__init__()
        model = method.model
        self.frozen = [model.backbone]   # a list: not registered as a submodule
        self.prompt = nn.Parameter(model.prompts[m].detach().clone())
        self.head = nn.Linear(model.head.weight.shape[2], model.head.weight.shape[1])
        with torch.no_grad():
            self.head.weight.copy_(model.head.weight[m])
            self.head.bias.copy_(model.head.bias[m])

    def forward(self, x: Tensor) -> Tensor:
        """Logits of this component (VPT-shallow: the prompt tokens inserted before block 0)."""
        tokens = self.frozen[0].forward_tokens(x, {0: self.prompt}, mode="insert")
        return self.head(tokens[:, 0])

    def adopt(self, state: dict[str, Tensor], m: int) -> None:
        """Component m of our stacked global tensors copied in: the next stage starts bit-identical."""
        with torch.no_grad():
            self.prompt.copy_(state["prompts"][m])
            self.head.weight.copy_(state["head.weight"][m])
            self.head.bias.copy_(state["head.bias"][m])


class FixedLoader:
    """Their iterators: our fixed batches as (x, y, indices), ``dataset`` for its length."""

    def __init__(self, batches: list[tuple[Tensor, Tensor]]) -> None:
        self.batches = batches
        self.dataset = range(sum(len(y) for _, y in batches))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """The batches in order, with each sample's index in the client's data (a list iterator: their client holds
        one, and a list's can be deep-copied)."""
        out, start = [], 0
        for x, y in self.batches:
            out.append((x, y, torch.arange(start, start + len(y))))
            start += len(y)
        return iter(out)


class _NoLog:
    """Their tensorboard logger: nothing is written."""

    def add_scalar(self, *args: Any) -> None:
        """Ignored."""


def _accuracy(y_pred: Tensor, y: Tensor) -> Tensor:
    """Their metric (utils/metrics.py's accuracy: correct predictions, summed)."""
    return (y_pred.argmax(dim=1) == y).float().sum()


def _ours() -> FedEM:
    """Our FedEM on vit_mini (a seeded random draw), 3 components of one prompt token."""
    torch.manual_seed(0)
    return FedEM(PromptedViT(build_vit("vit_mini")), CLASSES, {"components": M, "num_prompts": 1})


def _learner(official: SimpleNamespace, method: FedEM, m: int) -> Any:
    """Their Learner of component m: per-sample cross-entropy, their SGD (run_experiment / utils/optim.py)."""
    model = Component(method, m)
    return official.learner.Learner(model, nn.CrossEntropyLoss(reduction="none"), _accuracy, "cpu",
                                    _their_sgd(model))


def _their_sgd(model: nn.Module) -> torch.optim.Optimizer:
    """utils/optim.py's get_optimizer("sgd"): momentum 0.9, weight decay 5e-4, the trainable tensors."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9,
                           weight_decay=5e-4)


def _ensemble(official: SimpleNamespace, method: FedEM) -> Any:
    """Their LearnersEnsemble of our M components, uniform π (run_experiment's learners_weights)."""
    return official.ensemble.LearnersEnsemble([_learner(official, method, m) for m in range(M)], torch.ones(M) / M)


def _batches(n: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """A client's fixed batches of BATCH images and labels."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return [(x[s:s + BATCH], y[s:s + BATCH]) for s in range(0, n, BATCH)]


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours, start = [], 0
    for x, y in batches:
        ours.append(Batch(x, y, torch.arange(start, start + len(y)), {}))
        start += len(y)
    return ClientData(cid, start, lambda: iter(ours), torch.Generator().manual_seed(cid))


def _close(a: Tensor, b: Tensor, what: str) -> None:
    """assert_close within fp32 tolerance, the worst differences printed with FEDPROMPT_VERBOSE."""
    a, b = a.detach().double(), b.detach().double()
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    if VERBOSE:
        diff = (a - b).abs()
        print(f"{what}: max abs {float(diff.max()):.2e}, max rel {float((diff / b.abs().clamp_min(1e-3)).max()):.2e}")


def _stacked(ensemble: Any) -> dict[str, Tensor]:
    """Their M learners' tensors stacked as our state (prompts (M, n, D), head (M, C, D) and (M, C))."""
    models = [learner.model for learner in ensemble.learners]
    return {"prompts": torch.stack([m.prompt.detach() for m in models]),
            "head.weight": torch.stack([m.head.weight.detach() for m in models]),
            "head.bias": torch.stack([m.head.bias.detach() for m in models])}


def _compare_components(ours: dict[str, Tensor], ensemble: Any, what: str) -> None:
    """Every stacked component tensor against their learners'."""
    for k, v in _stacked(ensemble).items():
        _close(ours[k], v, f"{what} {k}")


def _their_client(official: SimpleNamespace, method: FedEM, train: list, test: list) -> Any:
    """Their MixtureClient over our batches (train and val iterators: the same fixed batches)."""
    return official.client.MixtureClient(_ensemble(official, method), FixedLoader(train), FixedLoader(train),
                                         FixedLoader(test), _NoLog(), EPOCHS)


def _their_server(official: SimpleNamespace, method: FedEM, clients: list, rate: float = 1.0) -> Any:
    """Their CentralizedAggregator (its __init__ evaluates every client once: write_logs)."""
    return official.aggregator.CentralizedAggregator(clients, _ensemble(official, method), log_freq=10 ** 6,
                                                     global_train_logger=_NoLog(), global_test_logger=_NoLog(),
                                                     sampling_rate=rate, seed=0)


# ---- the tests ---------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:The use of `x.T`")   # their learner.py:189 on a 1-d loss vector
def test_two_rounds_of_e_step_m_step_aggregation_and_mixture_prediction_equal_the_official(official):
    """q, π, the M-step's components, the server's per-component average and the mixture's test NLL, two rounds."""
    method = _ours()
    data = {c: _batches(n, 30 + c) for c, n in enumerate(SIZES)}
    test = _batches(BATCH, 99)
    clients = [_their_client(official, method, data[c], test) for c in data]
    server = _their_server(official, method, clients)
    settings = TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=SGD)
    info = RoundInfo(round=0, num_clients=len(SIZES), participation=1.0, seed=0)
    ours_server = method.strategy.init_state(len(SIZES))
    states = {c: method.client.init_state(c) for c in data}
    kept = None

    for r in (1, 2):
        results = []
        for c, client in enumerate(clients):
            down = method.strategy.configure(ours_server, c)
            model = method.model_for(c)
            with attention_backend("cpu"):
                # the E-step's q from the start-of-round components and π, as our client computes it
                method.client.start(model, c, states[c], down)
                pi_old = model.pi.detach().clone()
                with torch.no_grad():
                    q = torch.cat([responsibilities(component_losses(model, b.x, b.y), pi_old)
                                   for b in _data(c, data[c]).batches()], dim=1)
                model.train()
                states[c], res = method.client.fit(c, states[c], down, _data(c, data[c]), settings)
                if r == 2:
                    if c == 0:   # the documented difference: their learners keep their momentum across rounds
                        kept = copy.deepcopy(client)
                        kept.step()
                    for learner in client.learners_ensemble.learners:
                        learner.optimizer = _their_sgd(learner.model)   # ours: fresh each round
                client.step()
            results.append(res)
            _close(q, client.samples_weights, f"round {r} client {c} responsibilities q")
            assert float(q.max() - q.min()) > 0.05                       # responsibilities that differ
            _close(states[c]["model"]["pi"], client.learners_ensemble.learners_weights, f"round {r} client {c} π")
            _compare_components(res.uplink["model"], client.learners_ensemble, f"round {r} client {c}")
            moved = {k: float((res.uplink["model"][k] - down["model"][k]).abs().max()) for k in down["model"]}
            assert min(moved.values()) > 1e-3, moved                     # every component tensor trained
            if kept is not None and c == 0:
                apart = max(float((res.uplink["model"][k] - v).abs().max())
                            for k, v in _stacked(kept.learners_ensemble).items())
                assert apart > 1e-4, apart

        ours_server = method.strategy.aggregate(info, ours_server, results)
        # their mix() after the client steps: average_learners per component over all clients, then update_clients
        for m, learner in enumerate(server.global_learners_ensemble):
            official.torch_utils.average_learners([cl.learners_ensemble[m] for cl in server.clients], learner,
                                                  weights=server.clients_weights)
        _compare_components(ours_server["model"], server.global_learners_ensemble, f"round {r} global")
        for m, learner in enumerate(server.global_learners_ensemble):
            learner.model.adopt(ours_server["model"], m)   # the next stage from bit-identical tensors
        server.update_clients()

        # the personalised mixture on the test batches: their evaluate_iterator's NLL against ours
        model = method.model
        for c, client in enumerate(clients):
            with attention_backend("cpu"):
                their_loss, their_acc = client.learners_ensemble.evaluate_iterator(FixedLoader(test))
                method.evaluator.load(model, c, ours_server, states[c], None)
                log_probs = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {}))
                                       for x, y in test])
            labels = torch.cat([y for _, y in test])
            _close(F.nll_loss(log_probs, labels).reshape(1), torch.tensor([float(their_loss)]),
                   f"round {r} client {c} mixture NLL")
            assert their_acc == pytest.approx(float((log_probs.argmax(1) == labels).float().mean()))


def test_partial_participation_their_server_step_is_the_sampled_share_of_ours(official):
    """Documented: with 1 of 2 clients sampled, their mix() averages over all clients (the other holding the
    previous components): θ + (n_t / n)(θ_t − θ), where ours takes θ_t (the sampled clients' FedAvg)."""
    method = _ours()
    data = {c: _batches(n, 40 + c) for c, n in enumerate(SIZES)}
    test = _batches(BATCH, 98)
    clients = [_their_client(official, method, data[c], test) for c in data]
    server = _their_server(official, method, clients, rate=0.5)
    start = {k: v.detach().clone() for k, v in method.model.state_dict().items() if k != "pi"}
    with attention_backend("cpu"):
        server.mix()                              # samples one client, its step, the average over all, the copy
        (sampled,) = server.sampled_clients
        t = clients.index(sampled)
        method.model_for(t).train()
        _, res = method.client.fit(t, method.client.init_state(t),
                                   method.strategy.configure(method.strategy.init_state(2), t), _data(t, data[t]),
                                   TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=SGD))
    ours = method.strategy.aggregate(RoundInfo(0, 2, 0.5, 0), method.strategy.init_state(2), [res])["model"]
    share = SIZES[t] / sum(SIZES)
    theirs = _stacked(server.global_learners_ensemble)
    for k, v in theirs.items():
        _close(ours[k], res.uplink["model"][k], f"ours: the sampled client's {k}")
        _close(v, start[k] + share * (ours[k] - start[k]), f"theirs: θ + n_t/n (θ_t − θ), {k}")
        assert float((ours[k] - v).abs().max()) > 1e-3
