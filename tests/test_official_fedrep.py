"""FedRep against the original authors' code (github.com/lgcollins/FedRep, HEAD d82e629), number for number.

Opt-in: ``FEDPROMPT_FEDREP_OFFICIAL`` names a checkout (``git archive HEAD``). Their ``main_fedrep.py`` runs as a
script (``runpy``, ``--alg fedrep``) from that checkout with their ``utils/options.py``, ``models/Update.py``
(``LocalUpdate``), ``models/test.py`` (``test_img_local_all``) and ``FedProx.py``; nothing of it is copied here. Their
harness's data and model loader (``utils/train_utils.py``: torchvision datasets, their CNNs) is a stand-in that hands
their script our model and our tiny data; their train loaders are made sequential (they shuffle), so both sides see
the same batches. Their ``models/test.py`` mixes a tab with spaces in one indentation (line 108), which Python 3
refuses (``TabError``); it is compiled here with its tabs expanded to 8 columns (Python 2's reading). CI has no
checkout and no internet: every test skips there.

    FEDPROMPT_FEDREP_OFFICIAL=/tmp/fedrep_official python -m pytest -n 0 tests/test_official_fedrep.py

Both sides: the same model (``representation: prompts``: our VPT-shallow ``vit_mini``, their copy's frozen tensors
buffers, so the prompt and head are its parameters; ``representation: backbone``: our ``resnet8_pft_mini`` + head
entire), their representation keys (``w_glob_keys``) = our shared keys, their optimiser (SGD lr 0.05, momentum 0.5,
weight decay 1e-4 on all but biases), fp32 on the CPU, 4 clients of unequal size, ``frac`` 0.7 (2 a round), 2 rounds
of E = 3 (head 2 epochs, then body 1) and their final round. Recorded from their run and compared with ours, each
stage from bit-identical inputs (ours adopts their tensors once compared): what a client starts from (global
representation, its own head), its local update (head after the head phase, representation after the body phase),
its loss, the upload, the server's average, and every client's personalised evaluation (the scored model, accuracy
and test loss) each round. Differences, asserted as what they are: their CIFAR/MNIST path weighs clients equally
(``lens = np.ones``, main_fedrep.py:30), ours by sample count; their final round has every client fine-tune its head
alone for max(10, E − 1) epochs before the last evaluation (main_fedrep.py:129-130, Update.py:591, 602), ours has no
such round; their SGD exempts biases from weight decay (Update.py:552-565), ours decays every trained tensor; at E = 1
their client trains no head (head_eps = 0, Update.py:593), ours one head epoch. Found: a client not yet trained
holds, in their code, the average of the last round's heads (its ``w_locals`` alias ``net_glob``'s tensors,
main_fedrep.py:111-115, 188), ours its initial head (the paper's personal head); ours scored or trained from their
head is theirs. Every compared quantity is bit-identical here (max abs difference 0).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import fedcore.engine.optim as optim
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.backbones.vit import build_vit
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, module_state
from fedcore.engine.sampling import clients_per_round
from fedcore.methods.fedrep import FedRep
from fedcore.official_code import checkout_on_path, standin_modules
from official_support import ATOL, RTOL, assert_state_close

ENV = "FEDPROMPT_FEDREP_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a local checkout of "
                                "github.com/lgcollins/FedRep (none in CI, which has no internet)")

CLASSES, BATCH, LR, EPOCHS, ROUNDS = 5, 8, 0.05, 3, 2
SIZES = (3, 2, 3, 1)                      # training batches per client
FRAC = 0.7                                # theirs: int(0.7 * 4) = 2 clients a round
MOMENTUM, DECAY = 0.5, 1e-4               # their LocalUpdate's SGD (hard-coded)
SGD = {"name": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": DECAY}
THEIR_PACKAGES = ("models", "utils", "FedProx", "comm_helpers")
VERBOSE = bool(os.environ.get("FEDPROMPT_VERBOSE"))
WORST: dict[str, float] = {}


# ---- the shared model and data -----------------------------------------------------------------------------------
def _ours(representation: str, **params: Any) -> FedRep:
    """Our FedRep on a seeded ``vit_mini`` (prompts) or ``resnet8_pft_mini`` (backbone), CLASSES-way head."""
    torch.manual_seed(0)
    if representation == "prompts":
        return FedRep(PromptedViT(build_vit("vit_mini")), CLASSES, params)
    return FedRep(prompt_adapter(build_backbone("resnet8_pft_mini")), CLASSES, {"representation": "backbone",
                                                                                 **params})


def _image_size(representation: str) -> int:
    """vit_mini's input, or the ResNet's."""
    return 16 if representation == "prompts" else 32


def _their_model(method: FedRep) -> nn.Module:
    """Their ``net_glob``: a copy of our model whose frozen tensors are buffers (their head phase trains every
    parameter not in ``w_glob_keys``), with the ``weight_keys`` their CIFAR branch reads: indices 0, 1, 3, 4 are the
    representation (main_fedrep.py:70), index 2 the head, as in their ``CNNCifar``."""
    theirs = copy.deepcopy(method.model)
    for module in theirs.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad:
                del module._parameters[name]
                module.register_buffer(name, p.detach())
    shared = method.client.shared_keys(method.keys(0))
    theirs.weight_keys = [shared, [], method.client.personal_keys(method.keys(0)), [], []]
    return theirs


def _data(representation: str) -> SimpleNamespace:
    """Train and test samples of every client (labels from a client-specific subset of classes)."""
    g, size = torch.Generator().manual_seed(5), _image_size(representation)
    train, test, users_train, users_test = [], [], {}, {}
    for c, n in enumerate(SIZES):
        classes = torch.tensor([k for k in range(CLASSES) if k != c])
        for split, count, users in ((train, n * BATCH, users_train), (test, 2 * BATCH, users_test)):
            users[c] = np.arange(len(split), len(split) + count)
            split += [(torch.randn(3, size, size, generator=g),
                       int(classes[torch.randint(len(classes), (), generator=g)])) for _ in range(count)]
    return SimpleNamespace(train=train, test=test, users_train=users_train, users_test=users_test)


def _batches(samples: list, idxs: np.ndarray) -> list[Batch]:
    """Our batches of ``samples[idxs]``, in this order (all full)."""
    x = torch.stack([samples[i][0] for i in idxs])
    y = torch.tensor([samples[i][1] for i in idxs])
    return [Batch(x[i:i + BATCH], y[i:i + BATCH], torch.arange(BATCH), {}) for i in range(0, len(y), BATCH)]


def _client_data(cid: int, batches: list[Batch], epochs: int = EPOCHS) -> ClientData:
    """Our ClientData over exactly these batches, every epoch."""
    return ClientData(cid, sum(len(b.y) for b in batches), lambda: iter(batches), torch.Generator().manual_seed(cid),
                      settings=TrainSettings(local_epochs=epochs, batch_size=BATCH, optimizer=dict(SGD)))


@contextlib.contextmanager
def _their_optimiser(*models: nn.Module) -> Iterator[None]:
    """Our clients build their SGD's parameter groups (Update.py:552-565): weight decay on every tensor but those
    named ``bias``. Only to show that this is the one optimiser difference (``test_..._bias_decay``)."""
    biases = {id(p) for model in models for n, p in model.named_parameters() if "bias" in n}
    plain = optim.make_optimizer

    def grouped(params: list, cfg: dict) -> torch.optim.Optimizer:
        groups = [{"params": [p for p in params if id(p) not in biases], "weight_decay": DECAY},
                  {"params": [p for p in params if id(p) in biases], "weight_decay": 0.0}]
        return torch.optim.SGD([g for g in groups if g["params"]], lr=LR, momentum=MOMENTUM)
    optim.make_optimizer = grouped
    try:
        yield
    finally:
        optim.make_optimizer = plain


def _close(ours: dict[str, Tensor], theirs: dict[str, Tensor], what: str, keys: list[str] | None = None) -> None:
    """Every named floating tensor equal to fp32 tolerance; the largest differences are kept for the summary."""
    keys = [k for k in (list(ours) if keys is None else keys) if ours[k].is_floating_point()]
    assert keys, what
    worst_abs, _ = assert_state_close(ours, theirs, what, keys, verbose=VERBOSE)
    kind = what.split(":")[0]
    WORST[kind] = max(WORST.get(kind, 0.0), worst_abs)


def _copy(state: dict[str, Tensor], keys: list[str]) -> dict[str, Tensor]:
    """Detached clones of ``state[keys]``."""
    return {k: state[k].detach().clone() for k in keys}


# ---- running their script ----------------------------------------------------------------------------------------
def _their_test_module(root: Path) -> ModuleType:
    """Their ``models/test.py`` compiled with its tabs expanded (Python 3 refuses its mixed indentation)."""
    path = root / "models" / "test.py"
    mod = ModuleType("models.test")
    mod.__file__ = str(path)
    sys.modules["models.test"] = mod
    exec(compile(path.read_text().expandtabs(8), str(path), "exec"), mod.__dict__)
    return mod


def _run_theirs(root: Path, net: nn.Module, data: SimpleNamespace, tmp: Path, local_ep: int = EPOCHS,
                rounds: int = ROUNDS) -> SimpleNamespace:
    """Their ``main_fedrep.py`` on ``net`` and ``data``; records every ``LocalUpdate.train`` (the client, its start
    and end state, its loss) and every client evaluation (the scored state, accuracy, loss)."""
    rec = SimpleNamespace(fits=[], evals=[], users_train=data.users_train, module=None)
    loader = standin_modules({"utils.train_utils": {
        "get_data": lambda args: (data.train, data.test, data.users_train, data.users_test),
        "get_model": lambda args: net, "read_data": None}})
    argv = ["main_fedrep.py", "--alg", "fedrep", "--dataset", "cifar10", "--num_users", str(len(SIZES)),
            "--frac", str(FRAC), "--local_ep", str(local_ep), "--local_rep_ep", "1", "--local_bs", str(BATCH),
            "--lr", str(LR), "--epochs", str(rounds), "--gpu", "-1", "--num_classes", str(CLASSES),
            "--test_freq", "1", "--save_every", "100000"]
    (tmp / "save").mkdir(exist_ok=True)
    saved_argv, cwd, np_state = sys.argv, os.getcwd(), np.random.get_state()
    with checkout_on_path(root, THEIR_PACKAGES, loader), torch.random.fork_rng(devices=[]), \
            contextlib.redirect_stdout(open(os.devnull, "w")):
        tests = _their_test_module(root)
        update = importlib.import_module("models.Update")
        assert Path(update.__file__).resolve().is_relative_to(root)

        def sequential(dataset: Any, batch_size: int, shuffle: bool) -> DataLoader:
            """Their train loader without its shuffle: the samples in their (shuffled-once) order, every epoch."""
            return DataLoader(dataset, batch_size=batch_size, shuffle=False)

        class Recorded(update.LocalUpdate):
            """Their LocalUpdate, recording each client's round."""

            def train(self, net: nn.Module, w_glob_keys: list, last: bool = False, **kw: Any) -> tuple:
                """Theirs, with its start and end states and loss kept."""
                start = _copy(net.state_dict(), list(net.state_dict()))
                out = super().train(net, w_glob_keys, last=last, **kw)
                rec.fits.append(SimpleNamespace(cid=int(kw["idx"]), last=last, start=start, loss=out[1],
                                                end=_copy(out[0], list(out[0])), keys=list(w_glob_keys)))
                return out

        scored = tests.test_img_local

        def recorded_test(net_g: nn.Module, dataset: Any, args: Any, **kw: Any) -> tuple:
            """Their per-client test, with the scored model's state kept."""
            acc, loss = scored(net_g, dataset, args, **kw)
            rec.evals.append(SimpleNamespace(cid=int(kw["user_idx"]), state=_copy(net_g.state_dict(),
                                             list(net_g.state_dict())), acc=acc, loss=loss))
            return acc, loss

        update.DataLoader, update.LocalUpdate, tests.test_img_local = sequential, Recorded, recorded_test
        rec.module = update
        try:
            sys.argv = argv
            os.chdir(tmp)   # their script writes ./save/accs_*.csv
            np.random.seed(1)
            runpy.run_path(str(root / "main_fedrep.py"), run_name="__main__")
        finally:
            sys.argv = saved_argv
            os.chdir(cwd)
            np.random.set_state(np_state)
    return rec


@pytest.fixture(scope="module")
def root() -> Path:
    """The checkout."""
    path = Path(os.environ[ENV]).resolve()
    if not (path / "main_fedrep.py").is_file() or not (path / "models" / "Update.py").is_file():
        pytest.fail(f"{ENV}={path} is not a checkout of lgcollins/FedRep (no main_fedrep.py, models/Update.py)")
    return path


# ---- the comparison ----------------------------------------------------------------------------------------------
def _evaluate(method: FedRep, cid: int, server: dict, state: dict, data: SimpleNamespace) -> tuple[dict, float, float]:
    """Our personalised evaluation of client ``cid``: the loaded state, accuracy (%), mean test loss."""
    model = method.model.eval()
    method.evaluator.load(model, cid, server, state, None)
    batches = _batches(data.test, data.users_test[cid])
    logits = torch.cat([method.evaluator.predict(model, b) for b in batches])
    labels = torch.cat([b.y for b in batches])
    acc = 100.0 * float((logits.argmax(1) == labels).sum()) / len(labels)
    loss = float(F.cross_entropy(logits, labels, reduction="sum")) / len(labels)
    return module_state(model, method.keys(cid)), acc, loss


def _own_head(method: FedRep, states: dict, c: int, seen: set, average: dict | None, theirs: dict,
              what: str) -> dict:
    """Client ``c``'s own head on both sides; returns theirs (what ours goes on from). UNDOCUMENTED difference: their
    ``w_locals`` of a client not yet trained are the state-dict tensors of ``net_glob`` itself (main_fedrep.py:111-115,
    not copies), which ``net_glob.load_state_dict(w_glob)`` (main_fedrep.py:188) overwrites in place with the round's
    average of EVERY key (main_fedrep.py:162-182), the heads included; so until its first round such a client holds
    the uniform average of the last round's trained heads, where ours keeps its initial head (each client's own)."""
    if c in seen:
        _close(states[c]["model"], theirs, f"state: {what} client {c} own head")
    else:
        _close(states[c]["model"], method.client.init_state(c)["model"], f"state: {what} client {c} initial head")
        if average is not None:
            _close(average, theirs, f"aliasing: {what} client {c} (not yet trained) holds the average head",
                   list(average))
            assert not torch.allclose(average["head.weight"].float(), states[c]["model"]["head.weight"])
    return {**states[c], "model": _copy(theirs, list(states[c]["model"]))}


def _average_head(fits: list) -> dict[str, Tensor]:
    """The uniform mean of the round's trained heads (what their net_glob holds after the round)."""
    keys = [k for k in fits[0].end if k.startswith("head.")]
    return {k: sum(f.end[k].double() for f in fits) / len(fits) for k in keys}


def _check_evaluation(method: FedRep, server: dict, states: dict, evals: list, data: SimpleNamespace,
                      seen: set, average: dict | None, what: str) -> None:
    """Every client's scored model, accuracy and loss equal theirs (test_img_local_all, all clients); a client not
    yet trained differs as ``_own_head`` says, and ours scored with their tensors is theirs."""
    assert [e.cid for e in evals] == list(range(len(SIZES)))
    for e in evals:
        state = _own_head(method, states, e.cid, seen, average, e.state, what)
        scored, acc, loss = _evaluate(method, e.cid, server, state, data)
        _close(scored, e.state, f"evaluation: {what} client {e.cid} scored model")
        assert acc == pytest.approx(e.acc, abs=1e-9), (what, e.cid)
        assert loss == pytest.approx(e.loss, rel=1e-5), (what, e.cid)


@pytest.mark.parametrize("representation", ["prompts", "backbone"])
def test_fedrep_rounds_uploads_average_and_evaluation_equal_the_original(root, tmp_path, representation):
    """Two rounds and their final round of their ``main_fedrep.py`` against our client, strategy and evaluator."""
    WORST.clear()
    method = _ours(representation)
    data = _data(representation)
    rec = _run_theirs(root, _their_model(method), data, tmp_path)
    shared = method.client.shared_keys(method.keys(0))
    head = method.client.personal_keys(method.keys(0))
    per_round = int(FRAC * len(SIZES))
    assert per_round == 2 and clients_per_round(len(SIZES), FRAC) == 3   # int there, round here (PFLlib's too)
    assert len(rec.fits) == ROUNDS * per_round + len(SIZES) and len(rec.evals) == (ROUNDS + 1) * len(SIZES)
    assert all(f.keys == shared for f in rec.fits)
    assert method.client.epochs(EPOCHS) == (EPOCHS - 1, 1)            # their head_eps = local_ep - local_rep_ep
    batches = {c: _batches(data.train, rec.users_train[c]) for c in range(len(SIZES))}

    server, states = method.strategy.init_state(len(SIZES)), {c: method.client.init_state(c) for c in range(len(SIZES))}
    tune = _ours(representation, head_epochs=max(10, EPOCHS - 1), body_epochs=0)   # their final round (below)
    seen, average = set(), None
    with _their_optimiser(method.model, tune.model):
        for r in range(ROUNDS):
            fits, results = rec.fits[r * per_round:(r + 1) * per_round], []
            assert not any(f.last for f in fits)
            for f in fits:
                c = f.cid
                down = method.strategy.configure(server, c)
                _close(down["model"], f.start, f"downlink: round {r + 1} client {c} representation")
                state = _own_head(method, states, c, seen, average, f.start, f"round {r + 1}")
                down = {**down, "model": _copy(f.start, shared)}
                method.model_for(c).train()
                states[c], res = method.client.fit(c, state, down, _client_data(c, batches[c]),
                                                   _client_data(c, batches[c]).settings)
                _close(res.uplink["model"], f.end, f"update: round {r + 1} client {c} uploaded representation")
                _close(states[c]["model"], f.end, f"update: round {r + 1} client {c} head")
                assert res.stats["loss"] == pytest.approx(f.loss, rel=1e-6)
                results.append(res)
            seen |= {f.cid for f in fits}
            average = _average_head(fits)
            # their CIFAR path weighs every client 1 (lens = np.ones): ours with equal weights is theirs
            equal = method.strategy.aggregate(RoundInfo(r + 1, len(SIZES), FRAC, 0), server,
                                              [FitResult(q.cid, 1, q.uplink, q.stats) for q in results])
            evals = rec.evals[r * len(SIZES):(r + 1) * len(SIZES)]
            _close(equal["model"], evals[0].state, f"server: round {r + 1} average", shared)
            ours = method.strategy.aggregate(RoundInfo(r + 1, len(SIZES), FRAC, 0), server, results)
            n = [q.num_samples for q in results]
            assert n[0] != n[1]
            for k in shared:   # documented: ours by sample count
                if ours["model"][k].is_floating_point():
                    weighted = sum(m / sum(n) * q.uplink["model"][k].double() for m, q in zip(n, results))
                    torch.testing.assert_close(ours["model"][k].double(), weighted, rtol=RTOL, atol=ATOL)
            assert not torch.allclose(ours["model"][shared[0]], equal["model"][shared[0]], rtol=RTOL, atol=ATOL)
            server = {**equal, "model": _copy(evals[0].state, shared)}   # on from their tensors
            _check_evaluation(method, server, states, evals, data, seen, average, f"round {r + 1}")
        assert len(seen) < len(SIZES)   # some client was never trained in the regular rounds

        # their final round: every client, head alone for max(10, E - 1) epochs, the representation not moved and
        # the average not loaded (main_fedrep.py:129-130, 187-188; Update.py:591, 602-607); ours has no such
        # round. It is exactly ours with head_epochs 10, body_epochs 0, run once more from the final state.
        last = rec.fits[ROUNDS * per_round:]
        assert all(f.last for f in last) and sorted(f.cid for f in last) == list(range(len(SIZES)))
        tuned = dict(states)
        for f in last:
            c = f.cid
            _close(server["model"], f.start, f"downlink: final round client {c} representation", shared)
            state = _own_head(method, states, c, seen, average, f.start, "final round")
            tune.model_for(c).train()
            tuned[c], res = tune.client.fit(c, state, method.strategy.configure(server, c),
                                            _client_data(c, batches[c]), _client_data(c, batches[c]).settings)
            _close(tuned[c]["model"], f.end, f"update: final round client {c} fine-tuned head")
            _close(res.uplink["model"], f.end, f"update: final round client {c} representation (BatchNorm statistics)")
            params = [k for k in shared if k in set(method.trainable_keys(c))]
            _close(res.uplink["model"], f.start, f"update: final round client {c} representation unchanged", params)
            assert res.stats["loss"] == pytest.approx(f.loss, rel=1e-6)
            assert not torch.allclose(tuned[c]["model"]["head.weight"], state["model"]["head.weight"])
        _check_evaluation(tune, server, tuned, rec.evals[ROUNDS * len(SIZES):], data, set(range(len(SIZES))), None,
                          "final round")
    print(f"FedRep ({representation}) max abs differences:", {k: f"{v:.1e}" for k, v in WORST.items()})


def test_fedrep_bias_decay_and_one_epoch_budget_differ_as_documented(root, tmp_path):
    """Their SGD exempts biases from weight decay (Update.py:552-565), ours decays every trained tensor: with our
    optimiser the head's bias (and, through it, the rest) moves off theirs. At E = 1 their client trains the
    representation only (head_eps = 0, Update.py:593), ours a head epoch first (``head_epochs`` None: at least 1);
    ours with ``head_epochs: 0`` is theirs."""
    method = _ours("prompts")
    data = _data("prompts")
    rec = _run_theirs(root, _their_model(method), data, tmp_path, local_ep=1, rounds=1)
    head = method.client.personal_keys(method.keys(0))
    shared = method.client.shared_keys(method.keys(0))
    f = rec.fits[0]
    batches = _batches(data.train, rec.users_train[f.cid])
    assert method.client.epochs(1) == (1, 1)
    torch.testing.assert_close(f.end["head.weight"], f.start["head.weight"], rtol=0, atol=0)   # no head epoch there
    state, down = {"model": _copy(f.start, head)}, {"model": _copy(f.start, shared)}

    zero = _ours("prompts", head_epochs=0)
    with _their_optimiser(zero.model):
        _, res = zero.client.fit(f.cid, state, down, _client_data(f.cid, batches, 1),
                                 _client_data(f.cid, batches, 1).settings)
    _close(res.uplink["model"], f.end, "update: E = 1, ours with head_epochs 0")
    with _their_optimiser(method.model):
        new, res = method.client.fit(f.cid, state, down, _client_data(f.cid, batches, 1),
                                     _client_data(f.cid, batches, 1).settings)
    assert not torch.allclose(new["model"]["head.weight"], f.end["head.weight"], rtol=RTOL, atol=ATOL)

    # the optimiser: one round of E = 3 from the same start, their groups vs ours (every tensor decayed)
    rec = _run_theirs(root, _their_model(method), data, tmp_path, rounds=1)
    f = rec.fits[0]
    batches = _client_data(f.cid, _batches(data.train, rec.users_train[f.cid]))
    state, down = {"model": _copy(f.start, head)}, {"model": _copy(f.start, shared)}
    with _their_optimiser(method.model):
        grouped, _ = method.client.fit(f.cid, state, down, batches, batches.settings)
    plain, _ = method.client.fit(f.cid, state, down, batches, batches.settings)
    _close(grouped["model"], f.end, "update: E = 3, ours with their parameter groups")
    # ours decays the bias by lr·wd·b a step (carried by momentum): small at wd 1e-4, but past fp32 rounding
    assert not torch.allclose(plain["model"]["head.bias"], f.end["head.bias"], rtol=RTOL, atol=ATOL)
    assert (plain["model"]["head.bias"] - f.end["head.bias"]).abs().max() > 3 * ATOL
