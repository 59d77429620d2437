"""Our FedGen against the original authors' code (github.com/zhuangdizhu/FedGen, HEAD dd5807c).

Their ``FLAlgorithms/servers/serverpFedGen.py`` (server: ``train_generator``, ``get_label_weights``), its base
``serverbase.py`` (``aggregate_parameters``, ``send_parameters``, ``evaluate``), ``users/userpFedGen.py`` (the
regularised local update) on ``userbase.py`` and ``trainmodel/generator.py`` (G, the diversity loss) are imported at
test time from the checkout named by ``FEDPROMPT_FEDGEN_OFFICIAL`` (``git -C <mirror> archive dd5807c | tar -x -C
/tmp/fedgen``); nothing of it is copied here. Without the variable every test skips (CI has no checkout, no
internet). Their server and users are built by their own constructors; only their data readers are stood in for
(``read_data`` returns our batches), ``h5py`` (result files) by an empty module.

Their clients run one model shared by all (MNIST/EMNIST CNN ``Net``): here every user's and the server's model is
``NetInterface``, their ``Net``'s call interface (``start_layer_idx=-1``: the last layer alone, models.py:94-129)
around copies of our client model (our ``resnet_mini_18`` + linear head; two clients of that architecture, so that
their whole-model average is defined). Same weights, same batches in a fixed order (their shuffled loader and its
``K`` steps per epoch replaced by our batches, one pass per epoch), plain SGD (their ``pFedIBOptimizer``), fp32 on
the CPU. Their random draws (``np.random.choice`` of labels, ``torch.rand`` noise) are replayed from ours
(``Draws``); every stage starts from bit-identical inputs (our tensors adopted once compared).

Compared, two rounds (round 2: client 0 alone): the local update (CE only in round 1, as theirs at ``glob_iter``
0; CE + CE(h(G(z, ŷ)), ŷ) in round 2, their ``gen_ratio`` 1, their annealed weight set to 1), the label counts,
the server's generator step (round 1, two teachers: their recorded gradient at every Adam step against their
objective written with our pieces; round 2, one teacher, their diversity loss and weight decay off: against our
``generator_loss``, and G and its Adam state after the steps against ours), the head average (their whole-model
average's head), what a client receives and how it is scored. The differences (DEVIATIONS.md "FedGen", the
method's docstring) are asserted as what they are.
Run: ``FEDPROMPT_FEDGEN_OFFICIAL=/tmp/fedgen python -m pytest -n 0 tests/test_official_fedgen.py`` (``-s``
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

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import RoundInfo, module_state
from fedcore.engine.sampling import stream_seed
from fedcore.methods import fedgen
from fedcore.methods.fedgen import FedGen, Generator, ensemble_logits, generator_loss, sample_labels, teacher_weights
from fedcore.official_code import checkout_on_path, standin_modules
from official_support import assert_state_close as _close
from official_support import random_batches

ENV = "FEDPROMPT_FEDGEN_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a checkout of FedGen "
                                "(github.com/zhuangdizhu/FedGen) to compare our FedGen against")

ARCH, CLASSES, BATCH, SIZE, LR, EPOCHS = "resnet_mini_18", 4, 8, 16, 0.05, 2
SGD = {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0}  # their pFedIBOptimizer: plain SGD
# Adam lr 0.01: its normalised steps carry the two sides' rounding into G (test_official_htfllib.py, ADAM_ATOL)
NOISE, HIDDEN, GEN_STEPS, GEN_LR, ADAM_ATOL = 6, 10, 5, 0.01, 5e-6
SEED = 0
DATASET = "Mnist-compare"   # their get_dataset_name -> "mnist": RUNCONFIGS / GENERATORCONFIGS["mnist"] are read
ANNEAL = 0.98               # their exp_lr_scheduler(glob_iter, decay=0.98) of the regulariser's weights
# our G's names for theirs (generator.py: fc_layers = [Linear, BatchNorm1d, ReLU], representation_layer)
GEN_NAMES = {"fc_layers.0.": "fc1.", "fc_layers.1.": "bn.", "representation_layer.": "fc2."}


# ---- importing FedGen -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fg() -> SimpleNamespace:
    """Their server, user, generator, config and data-utility modules."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "FLAlgorithms" / "servers" / "serverpFedGen.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of zhuangdizhu/FedGen (no FLAlgorithms/servers/serverpFedGen.py)")
    # their model_utils imports torchvision, whose import of torch._dynamo looks up specs: loaded before the stand-in
    importlib.import_module("torchvision")
    names = {"server": "FLAlgorithms.servers.serverpFedGen", "base": "FLAlgorithms.servers.serverbase",
             "user": "FLAlgorithms.users.userpFedGen", "gen": "FLAlgorithms.trainmodel.generator",
             "config": "utils.model_config", "utils": "utils.model_utils"}
    with checkout_on_path(root, ("FLAlgorithms", "utils"), standin_modules({"h5py": {}})):
        mods = {k: importlib.import_module(v) for k, v in names.items()}
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return SimpleNamespace(**mods)


# ---- the shared setting ---------------------------------------------------------------------------------------
# ``n`` batches of BATCH random images (3 x SIZE x SIZE), labels from the classes not in ``missing``
_batches = functools.partial(random_batches, batch=BATCH, classes=CLASSES, size=SIZE)


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid),
                      settings=TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=dict(SGD)))


class NetInterface(nn.Module):
    """Their ``Net``'s call interface around copies of our client model: ``forward(x, start_layer_idx, logit)``
    returns log-probabilities (``output``) and, when asked, the logits; ``start_layer_idx=-1`` runs the head alone
    (their ``mapping``, the last layer). Records what it scores in eval mode on images (their ``User.test``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.net, self.proj, self.head = (copy.deepcopy(m) for m in (model.net, model.proj, model.head))
        self.scored: list[Tensor] = []

    def forward(self, x: Tensor, start_layer_idx: int = 0, logit: bool = False) -> dict[str, Tensor]:
        """Their result dict."""
        z = self.head(x if start_layer_idx < 0 else self.proj(self.net(x)))
        if start_layer_idx == 0 and not self.training:
            self.scored.append(z.detach().clone())
        out = {"output": F.log_softmax(z, dim=1)}
        if logit:
            out["logit"] = z
        return out


def _named(model: nn.Module) -> dict[str, Tensor]:
    """A module's parameters and buffers by name (NetInterface: our model's names)."""
    items = list(model.named_parameters()) + list(model.named_buffers())
    return {k: v.detach().clone() for k, v in items}


def _adopt(model: nn.Module, ours: dict[str, Tensor]) -> None:
    """Our tensors into their module (names as ours), once compared: the next stage starts bit-identical."""
    theirs = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for k, v in ours.items():
            theirs[k].copy_(v)


def _gen_names(theirs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Their G's tensors under our names (their BatchNorm's running statistics dropped: ours keeps none)."""
    out = {}
    for k, v in theirs.items():
        prefix = k[:k.rindex(".") + 1]
        if prefix in GEN_NAMES and not k.endswith(("running_mean", "running_var", "num_batches_tracked")):
            out[GEN_NAMES[prefix] + k[len(prefix):]] = v
    return out


def _adopt_gen(gen: nn.Module, ours: dict[str, Tensor]) -> None:
    """Our G's parameters into theirs."""
    params = _gen_names(dict(gen.named_parameters()))
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(ours[k])


def _our_gen(params: dict[str, Tensor]) -> Generator:
    """A fresh Generator of ours holding ``params`` (our names), train mode, gradients on."""
    gen = Generator(NOISE, CLASSES, HIDDEN, params["fc2.weight"].shape[0])
    gen.load_state_dict(params)
    return gen.train()


class Draws:
    """Their draws replayed from ours. ``np.random.choice(labels, n)`` (uniform over ``labels``: the server's
    ``qualified_labels``, the user's ``available_labels``) becomes our ``sample_labels(space, n)`` from ``gen`` (None:
    torch's global generator, as our client; else our server's seeded generator), followed at once by the noise of
    that G call from the same generator, as ours (labels, then noise: fedgen.py:155-157, 211-213). Their user's
    first G call of a batch (the ``generative_beta`` term, weight 0 here) gets side noise, so it draws nothing."""

    def __init__(self) -> None:
        self.gen: torch.Generator | None = None
        self.space: Tensor | None = None
        self.support: list[int] = []         # the labels their choice must be given
        self.stash: list[Tensor] = []
        self.log: list[tuple[Tensor, Tensor]] = []
        self.side = torch.Generator().manual_seed(12345)

    def choice(self, labels: Any, n: int) -> np.ndarray:
        """Our labels for theirs, after checking the labels they would draw from uniformly."""
        assert sorted(int(y) for y in labels) == self.support, f"their label support {list(labels)}"
        drawn = sample_labels(self.space, n, self.gen)
        self.stash.append(torch.rand(n, NOISE, generator=self.gen))
        self.log.append((drawn.clone(), self.stash[-1].clone()))
        return drawn.numpy()

    def rand(self, *size: Any, **kwargs: Any) -> Tensor:
        """The noise stashed with the last labels, else side noise."""
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else tuple(size)
        if self.stash:
            noise = self.stash.pop(0)
            assert tuple(noise.shape) == shape
            return noise
        return torch.rand(shape, generator=self.side)


class ModuleWithDraws:
    """A module (``np`` or ``torch``) for their code whose ``random.choice`` / ``rand`` are ``Draws``'."""

    def __init__(self, module: Any, draws: Draws) -> None:
        self._module, self._draws = module, draws
        if module is np:
            self.random = SimpleNamespace(choice=draws.choice)
        else:
            self.rand = draws.rand

    def __getattr__(self, name: str) -> Any:
        """Everything else: the module's."""
        return getattr(self._module, name)


class Recorder:
    """Their G optimiser, recording G's parameters and gradients before each step."""

    def __init__(self, opt: torch.optim.Optimizer, gen: nn.Module) -> None:
        self.opt, self.gen, self.steps = opt, gen, []

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Theirs."""
        self.opt.zero_grad(*args, **kwargs)

    def step(self) -> None:
        """Record, then step."""
        named = dict(self.gen.named_parameters())
        self.steps.append((_gen_names({k: p.detach().clone() for k, p in named.items()}),
                           _gen_names({k: p.grad.detach().clone() for k, p in named.items()})))
        self.opt.step()


def _their_run(fg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: nn.Module,
               data: dict[int, list], test: list) -> Any:
    """Their FedGen server and users, built by their constructors (under a forked torch generator: their loaders'
    iterators draw from it) over our data; each user then reads our batches in our order, one pass per epoch."""
    def read_data(dataset: str) -> tuple:
        ids = [f"f_{c:05d}" for c in data]
        train = {i: {"x": torch.cat([x for x, _ in data[c]]), "y": torch.cat([y for _, y in data[c]])}
                 for i, c in zip(ids, data)}
        held = {i: {"x": torch.cat([x for x, _ in test]), "y": torch.cat([y for _, y in test])} for i in ids}
        return ids, [], train, held, {}

    args = SimpleNamespace(dataset=DATASET, algorithm="FedGen", model="cnn", embedding=0, train=1,
                           batch_size=BATCH, gen_batch_size=BATCH, learning_rate=LR, num_glob_iters=2,
                           local_epochs=EPOCHS, num_users=len(data), K=1, beta=1.0, lamda=1, times=1,
                           result_path=str(tmp_path))
    monkeypatch.setattr(fg.server, "read_data", read_data)
    with torch.random.fork_rng(devices=[]):
        server = fg.server.FedGen(args, (NetInterface(model), "cnn"), 0)
    for user, batches in zip(server.users, data.values()):
        # their K steps an epoch from a shuffled loader (default K = 1) -> our batches, one pass an epoch
        user.trainloader, user.K = list(batches), len(batches)
        user.iter_trainloader = iter(user.trainloader)
        user.testloaderfull = list(test)
    return server


def _their_objective(gen_params: dict[str, Tensor], labels: Tensor, noise: Tensor, heads: list[dict[str, Tensor]],
                     counts: Tensor, eta: float, diversity: nn.Module) -> tuple[Tensor, Generator]:
    """Their server's loss (serverpFedGen.py:140-163, ensemble_beta 0) in our pieces, documented as "each teacher's
    CE weighted by w_{k,y}": their (B,) per-sample CE times the (B, 1) weights broadcasts to (B, B), whose mean is
    mean_b(w_{k,y_b}) · mean_b(CE_k,b); w from their counts; plus eta times their diversity loss. Returns the loss
    and the G (ours, holding ``gen_params``) it was computed with."""
    gen = _our_gen(gen_params)
    feats = gen(labels, noise)
    weights = teacher_weights(counts, counts.sum(1), labels, "labels")
    eye = torch.eye(len(heads))
    loss = sum(weights[:, k].mean() * F.cross_entropy(ensemble_logits(feats, eye[k].expand(len(labels), -1), heads),
                                                      labels) for k in range(len(heads)))
    return loss + eta * diversity(noise, feats), gen


def _grads(loss: Tensor, gen: nn.Module) -> dict[str, Tensor]:
    """d loss / d G's parameters, by our names."""
    named = dict(gen.named_parameters())
    return dict(zip(named, torch.autograd.grad(loss, list(named.values()))))


# ---- the check ------------------------------------------------------------------------------------------------
def test_fedgen_update_generator_step_aggregation_and_scores(fg, tmp_path, monkeypatch):
    """FedGen (userpFedGen.py, serverpFedGen.py, serverbase.py): two rounds as their ``Server.train`` runs them."""
    monkeypatch.setitem(fg.config.GENERATORCONFIGS, "mnist", (HIDDEN, 128, 3, CLASSES, NOISE))
    # their regulariser weight at glob_iter 1 is generative_alpha·0.98 (annealed): alpha 1/0.98 makes it our 1;
    # generative_beta (their KL term on the real batch, not ours) 0; the rest of their MNIST config as it is
    monkeypatch.setitem(fg.config.RUNCONFIGS, "mnist", {
        **fg.config.RUNCONFIGS["mnist"], "unique_labels": CLASSES, "ensemble_lr": GEN_LR,
        "ensemble_epochs": GEN_STEPS, "generative_alpha": 1 / ANNEAL, "generative_beta": 0})
    torch.manual_seed(0)
    method = FedGen([prompt_adapter(build_backbone(ARCH))], CLASSES,
                    {"noise_dim": NOISE, "hidden_dim": HIDDEN, "generator_lr": GEN_LR, "generator_steps": GEN_STEPS,
                     "generator_batch_size": BATCH, "teacher_weights": "labels", "keep_generator_optimizer": True},
                    client_backbones=[0, 0])
    assert method.feature_dim == 128
    data = {0: _batches(3, 40, missing=(2,)), 1: _batches(2, 41, missing=(0, 3))}
    test = _batches(1, 42)
    server = _their_run(fg, monkeypatch, tmp_path, method.model_for(0), data, test)
    users, gen = server.users, server.generative_model
    draws = Draws()
    for mod in (fg.server, fg.user):
        monkeypatch.setattr(mod, "np", ModuleWithDraws(np, draws))
    monkeypatch.setattr(fg.gen, "torch", ModuleWithDraws(torch, draws))
    state, states = method.strategy.init_state(2), {c: method.client.init_state(c) for c in data}
    _adopt_gen(gen, state["generator"])
    opt = server.generative_optimizer
    # their G optimiser (serverpFedGen.py:42-47): Adam at ensemble_lr with their config's weight decay, decayed
    # 0.98 a round; ours: Adam, no weight decay, constant lr (found by this check, now documented)
    assert opt.param_groups[0]["weight_decay"] == 1e-2 and server.generative_lr_scheduler.gamma == ANNEAL
    seen = {c: torch.bincount(torch.cat([y for _, y in data[c]]), minlength=CLASSES) for c in data}

    for r, clients in ((1, (0, 1)), (2, (0,))):
        glob_iter = r - 1
        server.selected_users = [users[c] for c in clients]
        results = []
        for c in clients:
            user, down = users[c], method.strategy.configure(state, c)
            # documented: the original's users receive the whole global model; ours keeps its body and takes the
            # head. Their user starts from our client's model (its body, the global head).
            _adopt(user.model, {**states[c]["model"], **down["model"]})
            if r == 1:   # documented: CE only in round 1 (no G yet), as theirs at glob_iter 0
                assert "generator" not in down
            else:
                space = down["label_counts"]
                draws.gen, draws.space = None, space
                draws.support = sorted(set(int(y) for c2 in data for y in torch.cat([y for _, y in data[c2]])))
                # their users draw ŷ uniformly over ``available_labels`` (every label in the union of the users'
                # data, model_utils.py:157-160, userpFedGen.py:60); ours in proportion to the label space
                assert sorted(int(y) for y in user.available_labels) == draws.support
                # their annealed weight: generative_alpha·0.98^glob_iter (userpFedGen.py:20-23, 52-53)
                assert user.exp_lr_scheduler(3, decay=ANNEAL, init_lr=2.0) == pytest.approx(2.0 * ANNEAL ** 3)
                assert user.exp_lr_scheduler(glob_iter, decay=ANNEAL, init_lr=user.generative_alpha) == \
                    pytest.approx(1.0, abs=1e-12)
                # documented: their users add β_t·KL(softmax(h(G(z, y))) ‖ p(x)) on the batch's own labels y
                # (userpFedGen.py:55-58), β_t = max(1e-4, β·0.98^t): 1e-4 even at β = 0, so the term is taken out
                # (recorded, weight 0) for the comparison, ours having none
                assert user.exp_lr_scheduler(glob_iter, decay=ANNEAL, init_lr=user.generative_beta) == 1e-4
                kl_terms: list[tuple[Tensor, Tensor]] = []
                kl = user.ensemble_loss
                monkeypatch.setattr(user, "ensemble_loss",
                                    lambda logp, target: kl_terms.append((logp.detach(), target)) or 0.0 * logp.sum())
                bn, kept = gen.fc_layers[1], (gen.fc_layers[1].running_mean, gen.fc_layers[1].running_var)
                bn.running_mean = bn.running_var = None   # eval mode then normalises by batch statistics, as ours
            torch.manual_seed(100 + c)
            user.train(glob_iter, personalized=server.personalized, early_stop=server.early_stop,
                       verbose=False, regularization=glob_iter > 0)
            if r == 2:
                # documented: their users run G in eval mode (userpFedGen.py:36): its running statistics, where ours
                # (and HtFLlib) use the batch's; undone above so that both read the batch's
                assert not gen.training
                bn.running_mean, bn.running_var = kept
                assert not draws.stash and len(draws.log) == len(kl_terms) == EPOCHS * len(data[c])
                assert all(float(kl(logp, target)) > 0 for logp, target in kl_terms)
                draws.log.clear()
            torch.manual_seed(100 + c)
            method.model_for(c).train()
            states[c], res = method.client.fit(c, states[c], down, _data(c, data[c]), _data(c, data[c]).settings)
            results.append(res)
            ours = module_state(method.model_for(c), method.keys(c))
            _close(ours, _named(user.model), f"FedGen round {r} client {c} model", list(ours))
            # label counts: ours n_{k,y} (a pass), theirs start at 1 and count every epoch (userpFedGen.py:25-31,
            # 45): EPOCHS·n + 1 (found by this check, now documented: their label weights are smoothed)
            assert torch.equal(res.uplink["label_counts"], seen[c].float())
            assert user.label_counts == {y: EPOCHS * int(seen[c][y]) + 1 for y in range(CLASSES)}
            # their users' lr decays 0.99 a round (userbase.py:58, userpFedGen.py:82; closed form at glob_iter):
            # ours is the experiment's, the same every round (found by this check, now documented)
            assert user.optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.99 ** glob_iter)
            _adopt(user.model, ours)

        # ---- the server: G's Adam steps, then the average ----------------------------------------------------
        their_counts = torch.tensor([[float(users[c].label_counts[y]) for y in range(CLASSES)] for c in clients])
        round_counts = torch.stack([res.uplink["label_counts"] for res in results])
        draws.gen = torch.Generator().manual_seed(stream_seed(SEED, r, 0, fedgen.SERVER_STREAM))
        draws.space = round_counts.sum(0)
        # documented: their labels are uniform over the labels some selected user saw (count > 1 with their
        # smoothing: MIN_SAMPLES_PER_LABEL, serverpFedGen.py:185-197); ours in proportion to the counts
        draws.support = [y for y in range(CLASSES) if int(round_counts[:, y].sum()) > 0]
        heads = [{k: v.detach().clone() for k, v in res.uplink["model"].items()} for res in results]
        if r == 2:
            # one teacher, their diversity loss (documented: ours has none) and weight decay off: their step is then
            # ours. Round 1's G (and Adam state) came from ours; their scheduler had decayed its lr (asserted).
            assert server.ensemble_eta == 1
            server.ensemble_eta = 0
            opt.param_groups[0]["weight_decay"] = 0.0
        recorder = Recorder(opt, gen)
        server.generative_optimizer = recorder
        server.train_generator(server.batch_size, epoches=server.ensemble_epochs // server.n_teacher_iters,
                               latent_layer_idx=server.latent_layer_idx, verbose=False)
        server.generative_optimizer = opt
        state = method.strategy.aggregate(RoundInfo(r, 2, 1.0, SEED), state, results)
        assert len(recorder.steps) == GEN_STEPS == len(draws.log) and not draws.stash
        worst = 0.0
        for (params, grads), (labels, noise) in zip(recorder.steps, draws.log):
            theirs_loss, g_theirs = _their_objective(params, labels, noise, heads, their_counts,
                                                     float(server.ensemble_eta), gen.diversity_loss)
            expected = _grads(theirs_loss, g_theirs)
            g_ours = _our_gen(params)
            ours_loss = generator_loss(g_ours(labels, noise), labels,
                                       teacher_weights(round_counts, round_counts.sum(1), labels, "labels"), heads)
            ours_grads = _grads(ours_loss, g_ours)
            if r == 1:
                _close(expected, grads, f"FedGen round {r} G gradient (their objective)", list(grads))
                # documented: ours (CE of the weighted ensemble, no diversity loss) is another objective
                assert not torch.allclose(ours_grads["fc2.weight"], grads["fc2.weight"], rtol=1e-3, atol=1e-5)
            else:
                _close(ours_grads, grads, f"FedGen round {r} G gradient (ours, one teacher)", list(grads))
                _close(expected, grads, f"FedGen round {r} G gradient (their objective)", list(grads))
            worst = max(worst, max(float((expected[k] - grads[k]).abs().max()) for k in grads))
        print(f"FedGen round {r} G gradients over {GEN_STEPS} steps: max abs diff {worst:.2e}")
        draws.log.clear()
        if r == 2:
            # the steps themselves, Adam state carried from round 1 (keep_generator_optimizer: theirs keeps one)
            theirs_g = _gen_names(_named(gen))
            # fc1.bias feeds G's BatchNorm (batch statistics), which removes it: its gradient is rounding (~1e-9),
            # which Adam's normalisation turns into ±lr steps (test_official_htfllib.py): left out
            diff = max(float((v - theirs_g[k]).abs().max()) for k, v in state["generator"].items() if k != "fc1.bias")
            print(f"FedGen round {r} G after the Adam steps: max abs diff {diff:.2e}")
            assert diff < ADAM_ATOL
            names = list(_gen_names(dict(gen.named_parameters())))
            params = list(gen.parameters())
            for i, k in enumerate(names):
                if k != "fc1.bias":
                    for s in ("exp_avg", "exp_avg_sq"):
                        torch.testing.assert_close(state["generator_optimizer"]["state"][i][s],
                                                   opt.state[params[i]][s], rtol=1e-4, atol=1e-9)
                assert int(state["generator_optimizer"]["state"][i]["step"]) == int(opt.state[params[i]]["step"])
        server.aggregate_parameters()
        theirs = _named(server.model)
        _close(state["model"], theirs, f"FedGen round {r} head average", list(state["model"]))
        # documented: the original averages the whole model (their G feeds a model shared by all), parameters only
        n = torch.tensor([float(len(torch.cat([y for _, y in data[c]]))) for c in clients])
        for k, _ in server.model.named_parameters():
            if not k.startswith("head."):
                avg = sum(w * _named(users[c].model)[k] for w, c in zip(n / n.sum(), clients))
                torch.testing.assert_close(theirs[k], avg, rtol=1e-5, atol=1e-6)
        if r == 1:
            # their G after its steps (their objective) is not ours: round 2 starts from ours, G and Adam state.
            # Their scheduler decayed the lr by 0.98 (asserted), undone here.
            assert opt.param_groups[0]["lr"] == pytest.approx(GEN_LR * ANNEAL)
            opt.param_groups[0]["lr"] = GEN_LR
            _adopt_gen(gen, state["generator"])
            params = dict(zip(_gen_names(dict(gen.named_parameters())), gen.parameters()))
            for i, k in enumerate(params):
                opt.state[params[k]] = {s: v.clone() for s, v in state["generator_optimizer"]["state"][i].items()}
            _adopt(server.model, {**_named(server.model), **state["model"]})

            # what each client receives and how it is scored (their evaluate() at the next round's start)
            server.send_parameters(mode=server.mode)
            for user in users:
                user.model.scored.clear()
            server.evaluate()
            for c, user in enumerate(users):
                # they send every parameter (not the BatchNorm statistics: each user keeps its own)
                got = _named(user.model)
                for k, p in server.model.named_parameters():
                    assert torch.equal(got[k], p.detach())
                model = method.model_for(c).eval()
                method.evaluator.load(model, c, state, states[c], _data(c, data[c]))
                ours = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {}))
                                  for x, y in test])
                their_logits = torch.cat(user.model.scored)
                # documented: they score the global whole model; ours scores the client's own extractor with the
                # global head. With their averaged body in our model, ours scores exactly as theirs.
                assert not torch.allclose(ours, their_logits, atol=1e-3)
                with torch.no_grad():
                    for k, p in model.named_parameters():
                        if not k.startswith("head."):
                            p.copy_(got[k])
                ours = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {}))
                                  for x, y in test])
                _close({"logits": ours}, {"logits": their_logits}, f"FedGen client {c} scores (their body)")
