"""FedBABU against its authors' own code (github.com/jhoon-oh/FedBABU, HEAD e34c15b).

Their ``main_fed.py`` (run with ``--local_upt_part body --aggr_part body``, as ``scripts/run_fedbabu.sh``) is
executed as a script (``runpy``) from the checkout named by ``FEDPROMPT_FEDBABU_OFFICIAL``, with their
``models/Update.py`` (``LocalUpdate``) and ``models/test.py`` (``test_img_local``); nothing of it is copied here.
Stood in: ``utils.options`` (their argument parser: our arguments), ``utils.train_utils`` (their CIFAR loaders and
model zoo: our tiny data and model), and the training loader's shuffle (their ``DataLoader(shuffle=True)`` draws
from the global generator; here the samples come in index order every epoch, as our batches do). Their local
updates and test scores are recorded as their script calls them. Without the variable every test skips.

Both sides get the same model (our ``resnet8_pft_mini`` extractor + linear head; theirs the same two modules, the
head named ``linear``, the name by which their code tells the head from the body), the same batches, SGD with
momentum 0.9 and weight decay, fp32 on the CPU. Compared, stage by stage (each stage from their inputs, so nothing
drifts): the local update of every client in both rounds (body, BatchNorm statistics, mean training loss; the head
untouched), what is uploaded, the server's average, the broadcast, the per-client score of the global body with
the fixed head (their per-round evaluation), and the personalisation: the entire model fine-tuned from the global
body (their ``analysis.ipynb`` fine-tunes with the same steps as ``LocalUpdate.train(body_lr=lr, head_lr=lr)``,
driven here) and its test score. Differences, asserted as what they are (DEVIATIONS.md "FedBABU"):
their server averages the clients with equal weights (main_fed.py:95-103), ours by sample count (equal here when
the weights are equal); their script decays the lr x0.1 at rounds E/2 and 3E/4 (main_fed.py:127-128), ours keeps
the experiment's lr (our round 2 is run at their lr to compare it); they upload the whole model (the untouched head
too) and drop the head at the broadcast (main_fed.py:113-125), ours uploads the body.
Where PFLlib's re-implementation (tests/test_official_pfllib.py) differs from the authors' code, ours follows:
the authors' in averaging the BatchNorm statistics with the body (their whole state dict; PFLlib moves parameters
only), PFLlib's in weighting by sample count; neither in when it fine-tunes (PFLlib: once after the last round,
the client's optimiser; the authors: once, the best round by test accuracy, lr 1e-3; ours: every evaluated round,
the experiment's optimiser, fresh).
Run: ``FEDPROMPT_FEDBABU_OFFICIAL=/tmp/fedbabu_official python -m pytest -n 0 tests/test_official_fedbabu.py``
(add ``-s`` for the largest differences found).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import runpy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import RoundInfo, module_state
from fedcore.methods.fedbabu import FedBABU
from fedcore.official_code import checkout_on_path, standin_modules
from official_support import ATOL, RTOL
from official_support import assert_state_close as _close

ENV = "FEDPROMPT_FEDBABU_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a checkout of "
                                "FedBABU's code (github.com/jhoon-oh/FedBABU) to compare our FedBABU against")

ARCH, CLASSES, BATCH, SIZE = "resnet8_pft_mini", 5, 8, 32
LR, MOMENTUM, WD, EPOCHS, ROUNDS = 0.05, 0.9, 1e-3, 2, 2
FT_LR, FT_EPOCHS = 0.01, 2
TRAIN_SIZES = (24, 24, 16)   # unequal: the servers' weights differ (equal-weight average asserted apart)
TEST_SIZE, TEST_BATCH = 12, 8
HEAD = ["head.weight", "head.bias"]


# ---- their side ------------------------------------------------------------------------------------------------
class TheirModel(nn.Module):
    """Our extractor and head under their names: ``linear`` is what their ``LocalUpdate.train`` (Update.py:52-53)
    and ``main_fed.py`` (:118) call the head."""

    def __init__(self, net: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.net, self.linear = net, head

    def forward(self, x: Tensor) -> Tensor:
        """Logits."""
        return self.linear(self.net(x))


def _ours_key(key: str) -> str:
    """Our name of one of their state keys."""
    return "head." + key[len("linear."):] if key.startswith("linear.") else key


def _named(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Their state under our names, copied (their optimiser updates in place)."""
    return {_ours_key(k): v.detach().clone() for k, v in state.items()}


def _in_order(dataset: Any, batch_size: int, shuffle: bool = False, **kwargs: Any) -> list[tuple[Tensor, Tensor]]:
    """Their training ``DataLoader`` with the samples in index order (no shuffle, the short last batch kept, as
    theirs): the same batches every epoch, which ours get too."""
    items = [dataset[i] for i in range(len(dataset))]
    cuts = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    return [(torch.stack([x for x, _ in cut]), torch.tensor([y for _, y in cut])) for cut in cuts]


def _args(**extra: Any) -> SimpleNamespace:
    """What their ``args_parser`` returns for a FedBABU run (scripts/run_fedbabu.sh's options, tiny sizes)."""
    return SimpleNamespace(**{**dict(
        epochs=ROUNDS, num_users=len(TRAIN_SIZES), shard_per_user=2, frac=1.0, local_ep=EPOCHS, local_bs=BATCH,
        bs=TEST_BATCH, lr=LR, momentum=MOMENTUM, wd=WD, model="tiny", dataset="tiny", iid=False,
        num_classes=CLASSES, gpu=-1, verbose=False, seed=1, test_freq=1, results_save="run1", unbalanced=False,
        server_data_ratio=0.0, local_upt_part="body", aggr_part="body", local_ep_pretrain=0, device="cpu"),
        **extra})


def _dataset(sizes: tuple[int, ...], seed: int) -> tuple[list[tuple[Tensor, int]], dict[int, np.ndarray]]:
    """Samples (image, label) of every client one after the other, and each client's indices."""
    g = torch.Generator().manual_seed(seed)
    items, users, start = [], {}, 0
    for c, n in enumerate(sizes):
        allowed = torch.tensor([k for k in range(CLASSES) if k != c])   # non-IID: client c never sees class c
        labels = allowed[torch.randint(len(allowed), (n,), generator=g)]
        items += [(torch.randn(3, SIZE, SIZE, generator=g), int(y)) for y in labels]
        users[c], start = np.arange(start, start + n), start + n
    return items, users


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Their ``main_fed.py`` run for ROUNDS rounds on our model and data, with every local update
    (``LocalUpdate.train``: start state, upload, loss, lrs) and every test score (``test_img_local``: the scored
    state, accuracy, loss) recorded; then their personalisation of each client's final model."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "main_fed.py").is_file() or not (root / "models" / "Update.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of jhoon-oh/FedBABU (no main_fed.py, models/Update.py)")
    torch.manual_seed(0)
    method = FedBABU(prompt_adapter(build_backbone(ARCH)), CLASSES, {"finetune_epochs": FT_EPOCHS})
    initial = copy.deepcopy(method.model)
    train, users_train = _dataset(TRAIN_SIZES, 10)
    test, users_test = _dataset((TEST_SIZE,) * len(TRAIN_SIZES), 11)
    args = _args()
    calls: list[dict] = []
    scores: list[dict] = []
    standins = standin_modules({
        "utils": {},
        "utils.options": {"args_parser": lambda: args},
        "utils.train_utils": {"get_data": lambda a: (train, test, users_train, users_test),
                              "get_model": lambda a: TheirModel(copy.deepcopy(initial.net),
                                                                copy.deepcopy(initial.head))}})
    cwd, deterministic, np_state = os.getcwd(), torch.backends.cudnn.deterministic, np.random.get_state()
    with checkout_on_path(root, ("models", "utils"), standins), torch.random.fork_rng(devices=[]):
        update, scoring = importlib.import_module("models.Update"), importlib.import_module("models.test")
        for mod in (update, scoring):
            assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
        update.DataLoader = _in_order
        base, score = update.LocalUpdate, scoring.test_img_local

        class Recorded(base):
            """Their ``LocalUpdate``, each ``train`` call recorded."""

            def __init__(self, args: Any, dataset: Any = None, idxs: Any = None, pretrain: bool = False) -> None:
                super().__init__(args, dataset, idxs, pretrain)
                self.client = next(c for c, ix in users_train.items() if np.array_equal(ix, idxs))

            def train(self, net: nn.Module, body_lr: float, head_lr: float, idx: int = -1,
                      local_eps: int | None = None) -> tuple[dict, float]:
                start = _named(net.state_dict())
                w, loss = super().train(net, body_lr, head_lr, idx, local_eps)
                calls.append({"client": self.client, "start": start, "upload": _named(w), "loss": loss,
                              "body_lr": body_lr, "head_lr": head_lr})
                return w, loss

        def recorded_score(net_g: nn.Module, dataset: Any, args: Any, user_idx: int = -1, idxs: Any = None,
                           return_features: bool = False) -> Any:
            out = score(net_g, dataset, args, user_idx=user_idx, idxs=idxs, return_features=return_features)
            scores.append({"user": user_idx, "state": _named(net_g.state_dict()), "acc": out[0], "loss": out[1]})
            return out

        update.LocalUpdate, scoring.test_img_local = Recorded, recorded_score
        try:
            os.chdir(tmp_path_factory.mktemp("fedbabu_run"))   # their script writes ./save/...
            done = runpy.run_path(str(root / "main_fed.py"), run_name="__main__")
            # personalisation (analysis.ipynb, "Initial / Personalized Accuracy"): every client fine-tunes the
            # entire model, SGD over body and head at one lr, momentum, no weight decay, then is scored
            ft_args = _args(wd=0.0, lr=FT_LR)
            tuned = []
            for u, net in enumerate(done["net_local_list"]):
                net = copy.deepcopy(net)
                w, _ = base(ft_args, train, users_train[u]).train(net, body_lr=FT_LR, head_lr=FT_LR,
                                                                  local_eps=FT_EPOCHS)
                acc, loss = score(net, test, ft_args, user_idx=u, idxs=users_test[u])
                tuned.append({"state": _named(w), "acc": acc, "loss": loss})
        finally:
            os.chdir(cwd)
            torch.backends.cudnn.deterministic = deterministic   # their script sets it globally
            np.random.set_state(np_state)
    return SimpleNamespace(method=method, calls=calls, scores=scores, tuned=tuned, train=train, test=test,
                           users_train=users_train, users_test=users_test, results=done["results"])


# ---- our side --------------------------------------------------------------------------------------------------
def _data(cid: int, items: list, idxs: np.ndarray, lr: float = LR, wd: float = WD,
          epochs: int = EPOCHS) -> ClientData:
    """Our ClientData over the client's samples in index order, in batches of BATCH, every epoch."""
    batches = [Batch(x, y, torch.arange(len(y)), {}) for x, y in _in_order([items[i] for i in idxs], BATCH)]
    settings = TrainSettings(local_epochs=epochs, batch_size=BATCH,
                             optimizer={"name": "sgd", "lr": lr, "momentum": MOMENTUM, "weight_decay": wd})
    return ClientData(cid, len(idxs), lambda: iter(batches), torch.Generator().manual_seed(cid), settings=settings)


def _score(method: FedBABU, model: nn.Module, items: list, idxs: np.ndarray) -> tuple[float, float]:
    """Our evaluator's accuracy (%) and mean CE over the client's test samples (their ``test_img_local`` units)."""
    model.eval()
    with torch.no_grad():
        batches = _in_order([items[i] for i in idxs], TEST_BATCH)
        logits = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {})) for x, y in batches])
        labels = torch.cat([y for _, y in batches])
    return 100.0 * float((logits.argmax(1) == labels).sum()) / len(labels), float(F.cross_entropy(logits, labels))


def _counted(keys: list[str]) -> list[str]:
    """State keys compared: all but BatchNorm's step counter (``num_batches_tracked``: unused with a momentum,
    and their average divides integers into floats, main_fed.py:103, ours rounds)."""
    return [k for k in keys if not k.endswith("num_batches_tracked")]


# ---- the checks ------------------------------------------------------------------------------------------------
def test_body_updates_uploads_server_average_and_broadcast(run):
    """Every client's local update (body and BatchNorm statistics trained, head frozen: Update.py:52-58 with
    ``head_lr=0``, main_fed.py:86-87), its mean loss, what it sends, and the server's average and broadcast
    (main_fed.py:95-125), two rounds, each from their inputs. Differences asserted: equal weights there, sample
    counts here; their lr decays x0.1 after round E/2; they upload the whole model and drop the head at the
    broadcast, ours uploads the body."""
    method, n = run.method, len(TRAIN_SIZES)
    body = _counted(method.client.shared_keys(method.keys(0)))
    assert body and not set(body) & set(HEAD)
    head0 = method.initial_state(0, HEAD)
    server = method.strategy.init_state(n)
    assert len(run.calls) == ROUNDS * n and len(run.scores) == ROUNDS * n
    for r in range(1, ROUNDS + 1):
        calls = run.calls[(r - 1) * n:r * n]
        assert sorted(c["client"] for c in calls) == list(range(n))   # frac 1: every client, in a random order
        # documented: their script's step decay (main_fed.py:127-128, at rounds E/2 and 3E/4); ours is constant
        lr = LR * (0.1 if r > ROUNDS // 2 else 1.0)
        results = []
        for call in calls:
            c = call["client"]
            assert call["body_lr"] == pytest.approx(lr) and call["head_lr"] == 0.0
            _close(server["model"], call["start"], f"round {r} client {c} start body", body)
            assert all(torch.equal(call["start"][k], head0[k]) for k in HEAD)   # the initial head, every round
            data = _data(c, run.train, run.users_train[c], lr=lr)
            method.model_for(c).train()   # as the engine leaves it
            _, res = method.client.fit(c, {}, method.strategy.configure(server, c), data, data.settings)
            assert set(res.uplink["model"]).isdisjoint(HEAD)                     # ours sends the body
            assert all(torch.equal(call["upload"][k], head0[k]) for k in HEAD)   # theirs the untouched head too
            _close(res.uplink["model"], call["upload"], f"round {r} client {c} upload (body)", body)
            assert res.stats["loss"] == pytest.approx(call["loss"], rel=1e-6)
            results.append(res)
        # their broadcast (every user's model when scored this round): the plain mean of the uploaded bodies
        broadcast = run.scores[(r - 1) * n:r * n]
        assert [s["user"] for s in broadcast] == list(range(n))
        equal = [dataclasses.replace(res, num_samples=1) for res in results]
        same_weights = method.strategy.aggregate(RoundInfo(r, n, 1.0, 0), server, equal)
        for s in broadcast:
            _close(same_weights["model"], s["state"], f"round {r} user {s['user']} broadcast body, equal weights",
                   body)
            assert all(torch.equal(s["state"][k], head0[k]) for k in HEAD)   # the head is not broadcast
        # documented: ours weights by sample count (24, 24, 16 here), theirs equally (main_fed.py:103)
        ours = method.strategy.aggregate(RoundInfo(r, n, 1.0, 0), server, results)
        total = sum(TRAIN_SIZES)
        for k in body[:3]:
            weighted = sum(TRAIN_SIZES[res.cid] / total * res.uplink["model"][k].double() for res in results)
            torch.testing.assert_close(ours["model"][k].double(), weighted, rtol=RTOL, atol=ATOL)
        assert not torch.allclose(ours["model"][body[0]], broadcast[0]["state"][body[0]], rtol=RTOL, atol=ATOL)
        server = {**server, "model": {k: broadcast[0]["state"][k] for k in server["model"]}}   # their next start


def test_fixed_head_scores_and_fine_tuned_personalisation(run):
    """Their per-round score (``test_img_local``: the global body with the fixed head, eval mode) equals ours with
    ``finetune_epochs: 0``, client by client and round by round; their personalisation (the entire model fine-tuned
    from the final global body, analysis.ipynb; ``LocalUpdate.train`` with one lr for body and head) equals our
    ``FineTunedEvaluator.load``, given the same optimiser (ours: the experiment's; theirs: lr ``args.lr``, momentum,
    no weight decay), and so does its score."""
    method, n = run.method, len(TRAIN_SIZES)
    keys = _counted(method.keys(0))
    torch.manual_seed(0)
    plain = FedBABU(prompt_adapter(build_backbone(ARCH)), CLASSES, {"finetune_epochs": 0})
    assert all(torch.equal(a, b) for a, b in zip(plain.initial_state(0, keys).values(),
                                                 method.initial_state(0, keys).values()))   # the same draw
    accs = []
    for r in range(1, ROUNDS + 1):
        for s in run.scores[(r - 1) * n:r * n]:
            u = s["user"]
            server = {"model": {k: s["state"][k] for k in plain.strategy.init_state(n)["model"]}}
            plain.evaluator.load(plain.model, u, server, {}, _data(u, run.train, run.users_train[u]))
            _close(module_state(plain.model, keys), s["state"], f"round {r} user {u} scored model", keys)
            acc, loss = _score(plain, plain.model, run.test, run.users_test[u])
            assert acc == s["acc"] and loss == pytest.approx(s["loss"], rel=1e-6), (r, u)
            accs.append(acc)
        # their round's number weights clients by test share (models/test.py:196-204): equal shares here
        assert run.results[r - 1][3] == pytest.approx(sum(accs[-n:]) / n)
    final = run.scores[-n:]
    for u, theirs in enumerate(run.tuned):
        server = {"model": {k: final[u]["state"][k] for k in method.strategy.init_state(n)["model"]}}
        method.evaluator.load(method.model, u, server, {},
                              _data(u, run.train, run.users_train[u], lr=FT_LR, wd=0.0, epochs=FT_EPOCHS))
        _close(module_state(method.model, keys), theirs["state"], f"user {u} fine-tuned model", keys)
        assert not torch.allclose(method.model.head.weight, final[u]["state"]["head.weight"])   # the head moved
        acc, loss = _score(method, method.model, run.test, run.users_test[u])
        assert acc == theirs["acc"] and loss == pytest.approx(theirs["loss"], rel=1e-5), u
        print(f"user {u}: fine-tuned acc {acc:.2f} (theirs {theirs['acc']:.2f}), loss {loss:.6f} "
              f"(theirs {theirs['loss']:.6f})")
