"""FedGH against the original authors' code (github.com/LipingYi/FedGH, HEAD ff50ac0), number for number.

Opt-in: ``FEDPROMPT_FEDGH_OFFICIAL`` names a checkout (``git archive HEAD``). Their model-heterogeneous script
``FedGH_Codes/experiments/FLHetero/FedGH_mh.py`` is imported at test time from that checkout and its ``train()`` is run
as it is; nothing of it is copied here. Their data (``experiments/node.py``: torchvision CIFAR loaders) is a stand-in
handing their loop our tiny batches in a fixed order, their CNNs and global-header ``FC`` are stand-ins returning
copies of our client models and of a seeded linear head (their modules' interface: ``(logits, representation)``,
the head last in the state dict, named ``fc3``), and their ``random.sample`` of clients keeps the clients' order.
Their import sets ``CUDA_VISIBLE_DEVICES`` and reseeds Python's ``random`` (FedGH_mh.py:23, 25): both are restored.
CI has no checkout and no internet: the test skips there.

    FEDPROMPT_FEDGH_OFFICIAL=/tmp/fedgh_official python -m pytest -n 0 tests/test_official_fedgh.py

Both sides: two heterogeneous clients (client 0: our ``resnet_mini_18``, 128 features; client 1: ``resnet_mini_50``,
512 pooled to 128, ``projection: pool``; + 128 -> 4 heads), their optimiser (SGD lr 0.05, momentum 0.9, weight
decay 1e-3, fresh per client and round, FedGH_mh.py:167), E = 2, two rounds, fixed batches with some classes absent
and unequal class counts per batch, fp32 on the CPU. Recorded from their run and compared with ours each round: every
client's trained model (extractor, BatchNorm statistics, local head), its uploaded per-class representations, the
server's CE gradient on the head over the uploaded (representation, label) pairs, and the client's evaluation.

Differences, asserted as what they are (DEVIATIONS.md "FedGH"):
* their server steps the clients' optimiser (``optimizer``, over the last client's model, FedGH_mh.py:167 vs 269),
  never one over the header ``net_FC``: the global header is the FC's random initialisation in every round
  (FedGH_mh.py:271) and its gradients only accumulate. Ours trains H_g (the paper's server step; HtFLlib's too).
  What their server would descend is compared instead: the summed per-pair CE gradient at their header equals
  ours (one full-batch SGD step from their header on their uploads, times the pair count over the lr);
* their upload is, per class, the mean over batches of each batch's class mean (FedGH_mh.py:227-248); ours (and
  HtFLlib's) the mean over all the client's samples of the class (the paper's local averaged representation);
* their first round trains each client behind its own initial head (FedGH_mh.py:169-170), ours behind H_g (client
  0's initial head, HtFLlib's); ours given their head reproduces their update;
* they evaluate the trained model with its locally trained head before the server step (FedGH_mh.py:213, the mean
  of per-batch accuracies; the reported loss is the last batch's over the batch count, FedGH_mh.py:40); ours each
  extractor with the new H_g (HtFLlib's, spec §3.3);
* they clip every gradient norm at 50 (FedGH_mh.py:200, 268), ours never: the clip is inactive here (asserted).
"""
from __future__ import annotations

import copy
import functools
import importlib
import os
import random
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, module_state
from fedcore.methods.fedgh import FedGH
from fedcore.official_code import checkout_on_path
from official_support import assert_state_close, random_batches

ENV = "FEDPROMPT_FEDGH_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a local checkout of "
                                "github.com/LipingYi/FedGH (none in CI, which has no internet)")

ARCHS, DIM, CLASSES, BATCH, SIZE = ("resnet_mini_18", "resnet_mini_50"), 128, 4, 8, 16
LR, MOMENTUM, DECAY, EPOCHS, ROUNDS = 0.05, 0.9, 1e-3, 2, 2
SGD = {"name": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": DECAY}
SERVER_LR = 1.0          # ours: one full-batch step, so (H0 - H1) / lr is the mean gradient with little rounding
CLIP = 50.0              # their clip_grad_norm_ bound (FedGH_mh.py:200, 268)
SEED = 0
WORST: dict[str, float] = {}


# ---- importing their script ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def official() -> ModuleType:
    """Their ``experiments.FLHetero.FedGH_mh`` module, imported from the checkout with its import-time side effects
    (``CUDA_VISIBLE_DEVICES``, ``random.seed(2022)``) undone."""
    root = Path(os.environ[ENV]).resolve() / "FedGH_Codes"
    if not (root / "experiments" / "FLHetero" / "FedGH_mh.py").is_file():
        pytest.fail(f"{ENV}={root.parent} is not a checkout of LipingYi/FedGH (no FedGH_Codes/experiments/FLHetero)")
    env, state = os.environ.get("CUDA_VISIBLE_DEVICES"), random.getstate()
    try:
        with checkout_on_path(root, ("experiments",)):
            mod = importlib.import_module("experiments.FLHetero.FedGH_mh")
    finally:
        random.setstate(state)
        if env is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env
    assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return mod


# ---- the shared setting ------------------------------------------------------------------------------------------
# ``n`` batches of BATCH random images (3 x SIZE x SIZE), labels from the classes not in ``missing``
_batches = functools.partial(random_batches, batch=BATCH, classes=CLASSES, size=SIZE)


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch and for the upload pass."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid),
                      settings=TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=dict(SGD)))


def _ours() -> FedGH:
    """Our FedGH, client 0 on resnet_mini_18, client 1 on resnet_mini_50 (pooled to DIM), seeded draws."""
    torch.manual_seed(0)
    return FedGH([prompt_adapter(build_backbone(a)) for a in ARCHS], CLASSES,
                 {"common_dim": DIM, "projection": "pool", "server_lr": SERVER_LR, "server_epochs": 1,
                  "server_batch_size": 64}, client_backbones=[0, 1])


class TheirNet(nn.Module):
    """Their CNN's interface around a copy of our client model: forward -> (logits, representation); the head is
    the state dict's last two entries (``fc3``: their code drops ``list(keys)[-2:]``, FedGH_mh.py:204-207)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.net, self.proj, self.fc3 = (copy.deepcopy(m) for m in (model.net, model.proj, model.head))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, representation)."""
        rep = self.proj(self.net(x))
        return self.fc3(rep), rep


class TheirHeader(nn.Module):
    """Their ``FC`` global header (a linear ``fc3``) recording what it is fed and, whenever their code takes its state
    dict (once a round, FedGH_mh.py:271), its weights and accumulated gradients."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc3 = nn.Linear(DIM, CLASSES)
        self.inputs: list[Tensor] = []
        self.snapshots: list[dict[str, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        """Logits of one representation."""
        self.inputs.append(x.detach().clone())
        return self.fc3(x)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """Their header's state, snapshotting its tensors and gradients first."""
        self.snapshots.append({**{f"head.{k}": p.detach().clone() for k, p in self.fc3.named_parameters()},
                               **{f"grad.{k}": p.grad.detach().clone() for k, p in self.fc3.named_parameters()}})
        return super().state_dict(*args, **kwargs)


def _their_order(batches: list[tuple[Tensor, Tensor]]) -> list[int]:
    """The classes of their per-client upload in their order: first appearance, each batch's ``unique`` ascending."""
    order: list[int] = []
    for _, y in batches:
        order += [int(c) for c in y.unique() if int(c) not in order]
    return order


def _close(ours: dict[str, Tensor], theirs: dict[str, Tensor], what: str) -> None:
    """Every named tensor equal to fp32 tolerance; keeps the largest differences for the report."""
    assert sorted(ours) == sorted(theirs), f"{what}: keys differ {sorted(set(ours) ^ set(theirs))}"
    worst_abs, _ = assert_state_close(ours, theirs, what)
    kind = re.sub(r"round \d+ |client \d+ | \(class \d+\)", "", what)
    WORST[kind] = max(WORST.get(kind, 0.0), worst_abs)


def _run_theirs(mod: ModuleType, nets: list[TheirNet], header: TheirHeader, data: dict[int, list], test: list,
                tmp: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Their ``train()`` for ROUNDS rounds on our models and batches; what it computed, recorded."""
    trained: list[dict[str, Any]] = []
    norms: list[float] = []
    evaluate, clip = mod.test_acc, torch.nn.utils.clip_grad_norm_

    def test_acc(net: nn.Module, loader: list, criteria: nn.Module) -> tuple[Tensor, float]:
        """Theirs, recording the model it scores (the trained model, FedGH_mh.py:213)."""
        loss, acc = evaluate(net, loader, criteria)
        trained.append({"state": copy.deepcopy(net.state_dict()), "loss": float(loss), "acc": acc})
        return loss, acc

    def clip_norm(params: Any, max_norm: float, *a: Any, **kw: Any) -> Tensor:
        """torch's clip, recording the norm it saw."""
        norm = clip(params, max_norm, *a, **kw)
        norms.append(float(norm))
        return norm

    def cnn(k: int) -> Any:
        """Their CNN_k: client k-1's model (clients use ``net_set[id % 5]``); CNN_3..5 unused with two clients."""
        return lambda n_kernels=16, out_dim=10: nets[k - 1] if k <= len(nets) else nn.Linear(1, 1)

    nodes = SimpleNamespace(train_loaders=[data[c] for c in sorted(data)], test_loaders=[test] * len(data),
                            val_loaders=[[]] * len(data), train_sample_count=[BATCH * len(data[c]) for c in data],
                            eval_sample_count=[0] * len(data), test_sample_count=[BATCH * len(test)] * len(data))
    with monkeypatch.context() as m, torch.random.fork_rng(devices=[]):
        m.setattr(mod, "BaseNodes", lambda *a, **kw: nodes)
        for k in range(1, 6):
            m.setattr(mod, f"CNN_{k}", cnn(k))
        m.setattr(mod, "FC", lambda in_dim=500, out_dim=10: header)
        m.setattr(mod, "random", SimpleNamespace(sample=lambda xs, k: list(xs)[:k]))   # the clients in order
        m.setattr(mod, "device", torch.device("cpu"), raising=False)   # their test_acc reads the script's global
        m.setattr(mod, "test_acc", test_acc)
        m.setattr(torch.nn.utils, "clip_grad_norm_", clip_norm)
        mod.train(data_name="cifar10", data_path="", classes_per_node=2, num_nodes=len(data), fraction=1,
                  steps=ROUNDS, epochs=EPOCHS, optim="sgd", lr=LR, inner_lr=LR, embed_lr=None, wd=DECAY,
                  inner_wd=0.0, embed_dim=-1, hyper_hid=1, n_hidden=1, n_kernels=16, bs=BATCH,
                  device=torch.device("cpu"), eval_every=1, save_path=tmp, seed=SEED, total_classes=CLASSES)
    return SimpleNamespace(trained=trained, norms=norms)


def _ours_named(theirs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Their model's state dict under our names (``fc3`` is our ``head``)."""
    return {("head." + k.removeprefix("fc3.")) if k.startswith("fc3.") else k: v for k, v in theirs.items()}


def _heads(d: dict[str, Tensor]) -> dict[str, Tensor]:
    """The head's tensors of a state."""
    return {k: v.clone() for k, v in d.items() if k.startswith("head.")}


# ---- the check ---------------------------------------------------------------------------------------------------
def test_fedgh_client_update_upload_server_gradient_and_evaluation(official, tmp_path, monkeypatch):
    """Two rounds of their ``FedGH_mh.py`` against ours, client by client: trained model, per-class upload, the
    server's CE gradient on the header, the evaluation; each documented difference asserted as what it is."""
    method = _ours()
    data = {0: _batches(3, 10, missing=(2,)), 1: _batches(2, 11, missing=(0, 3))}
    test = _batches(2, 12)
    initial_heads = {c: _heads(module_state(method.model_for(c), method.keys(c))) for c in data}
    nets = [TheirNet(method.model_for(c)) for c in data]
    header = TheirHeader(seed=123)
    their_h0 = {"head." + k: v.detach().clone() for k, v in header.fc3.named_parameters()}

    run = _run_theirs(official, nets, header, data, test, tmp_path, monkeypatch)
    assert len(run.trained) == ROUNDS * len(data) and len(header.snapshots) == ROUNDS

    # their server never moves the header (its optimiser holds the clients' parameters, FedGH_mh.py:167, 269)
    for snap in header.snapshots:
        for k, v in their_h0.items():
            assert torch.equal(snap[k], v), f"their global header {k} moved"
    # their clip (client and server, FedGH_mh.py:200, 268) never acted here, so ours (no clip) may match
    assert run.norms and max(run.norms) < CLIP, f"their gradient clip acted (max norm {max(run.norms):.3g})"

    state = method.strategy.init_state(len(data))
    states = {c: method.client.init_state(c) for c in data}
    # ours starts every client behind H_g = client 0's initial head (HtFLlib); theirs each behind its own
    _close(state["model"], initial_heads[0], "round 1 H_g (client 0's initial head)")
    assert not torch.equal(initial_heads[1]["head.weight"], initial_heads[0]["head.weight"])
    prev_grad = {k: torch.zeros_like(v) for k, v in their_h0.items()}
    rec = iter(run.trained)
    pairs_seen = 0
    for r in range(1, ROUNDS + 1):
        their_head = initial_heads if r == 1 else {c: their_h0 for c in data}   # what their clients start behind
        results, batch_means_differ = [], False
        for c in data:
            theirs = next(rec)
            model = method.model_for(c)
            model.train()
            downlink = method.strategy.configure({**state, "model": their_head[c]}, c)
            states[c], res = method.client.fit(c, states[c], downlink, _data(c, data[c]), _data(c, data[c]).settings)
            ours_state = module_state(model, method.keys(c))
            _close(ours_state, _ours_named(theirs["state"]), f"round {r} client {c} trained model")

            # upload: ours the class mean over all samples, theirs the mean of per-batch class means
            model.eval()
            with torch.no_grad():
                feats = [(model.features(x), y) for x, y in data[c]]
            order = _their_order(data[c])
            got = header.inputs[pairs_seen:pairs_seen + len(order)]
            pairs_seen += len(order)
            assert res.uplink["labels"].tolist() == sorted(order)
            for cls, rep in zip(order, got):
                per_batch = [f[y == cls].double().mean(0) for f, y in feats if bool((y == cls).any())]
                their_mean = torch.stack(per_batch).mean(0)
                all_samples = torch.cat([f[y == cls] for f, y in feats]).double().mean(0)
                _close({"rep": their_mean}, {"rep": rep}, f"round {r} client {c} their upload (class {cls})")
                ours_row = res.uplink["protos"][res.uplink["labels"].tolist().index(cls)]
                _close({"rep": all_samples}, {"rep": ours_row}, f"round {r} client {c} our upload (class {cls})")
                batch_means_differ |= bool((their_mean - all_samples).abs().max() > 1e-4)

            # evaluation: theirs scores the trained model with its local head (per-batch accuracy mean)
            with torch.no_grad():
                logits = [model.head(model.features(x)) for x, _ in test]
            acc = sum(float((lg.argmax(1) == y).float().mean()) for lg, (_, y) in zip(logits, test)) / len(test)
            assert acc == pytest.approx(theirs["acc"], abs=1e-12), f"round {r} client {c} their accuracy"
            last = float(F.cross_entropy(logits[-1], test[-1][1])) / len(test)   # their loss: the last batch's
            assert last == pytest.approx(theirs["loss"], rel=1e-6), f"round {r} client {c} their test loss"
            results.append(FitResult(c, _data(c, data[c]).num_samples,
                                     {"protos": torch.stack(got), "labels": torch.tensor(order)}, {}))
        assert batch_means_differ, "the data should make their mean of batch means differ from the class mean"

        # the server: ours from their header on their uploads (one full-batch step) vs their summed CE gradient
        n = sum(len(res.uplink["labels"]) for res in results)
        new = method.strategy.aggregate(RoundInfo(r, ROUNDS, 1.0, SEED), {**state, "model": their_h0}, results)
        snap = header.snapshots[r - 1]
        grad = {k: snap[k.replace("head.", "grad.")] - prev_grad[k] for k in their_h0}
        prev_grad = {k: snap[k.replace("head.", "grad.")] for k in their_h0}
        ours_grad = {k: (their_h0[k] - new["model"][k]) * n / SERVER_LR for k in their_h0}
        _close(ours_grad, grad, f"round {r} server CE gradient on the header ({n} pairs)")
        assert not torch.equal(new["model"]["head.weight"], their_h0["head.weight"]), "our H_g should move"
        state = new

        # ours scores each extractor with the new H_g (theirs: the local head, before the server step)
        for c in data:
            model = method.model_for(c).eval()
            method.evaluator.load(model, c, state, states[c], _data(c, data[c]))
            with torch.no_grad():
                scored = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {}))
                                    for x, y in test])
                with_hg = torch.cat([F.linear(model.features(x), state["model"]["head.weight"],
                                              state["model"]["head.bias"]) for x, _ in test])
            _close({"logits": scored}, {"logits": with_hg}, f"round {r} client {c} our logits with H_g")
    assert pairs_seen == len(header.inputs)
    print("largest absolute differences:", {k: f"{v:.1e}" for k, v in WORST.items()})
