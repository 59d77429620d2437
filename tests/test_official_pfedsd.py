"""Our pFedSD against the ORIGINAL authors' code (github.com/CGCL-codes/pFedSD, HEAD 8eba096), number for number.

Their ``pcode/workers/worker_pFedSD.py`` (``WorkerpFedSD``: ``_listen_to_master``, ``_recv_model_from_master``,
``_train`` / ``_train_AKT``, ``_send_model_to_master``), ``pcode/masters/master_pFedSD.py`` (``MasterpFedSD``: its
``__init__``, ``_activate_selected_clients``, ``_send_model_to_selected_clients``, ``_receive_models_from_selected_
clients``, ``update_local_models``, ``_aggregate_model``, ``_update_client_performance``), the optimiser, scheduler,
metrics and validation they call, and ``parameters.py`` (their argument parser, read for the configuration) are
imported at test time from the checkout named by ``FEDPROMPT_PFEDSD_OFFICIAL`` (``git archive`` of CGCL-codes/pFedSD);
nothing of it is copied here. Without the variable every test skips (CI has no checkout and no internet). Stood in:
``lmdb``, ``cv2``, ``torchcontrib`` (imported by their data loaders and an unused aggregator only).

Their harness is one MPI process per worker plus the master; here the master and the workers run one after another
in this process, each call in the order of their ``run`` loops (master_pFedSD.py:69-125, worker_pFedSD.py:32-51),
``torch.distributed`` replaced in their four modules by ``Wire`` (point-to-point copies queued per sender and
receiver). What is replaced besides: their model factory (``create_model.define_model``: our model, a fresh deep copy
per call as theirs builds one), their data (``prepare_local_train_loader``: our batches in a fixed order, and the
batches-per-epoch count their ``define_local_data_loader`` sets; the test loaders: our test batches),
``MasterBase.__init__`` / ``WorkerBase.__init__`` (the fields their methods read, without the process group and the
data sets; ``MasterpFedSD.__init__`` itself runs), their file logger and ``checkpoint.save_arguments``. Their
configuration is their own parser's (``parameters.get_args``) on the optimisation flags of their README's pFedSD
command (SGD, momentum 0.9, no Nesterov, MultiStepLR never reached, no warm-up) with our lr, batch size, epochs, λ,
T and no weight decay (FedPFT's; their README's 1e-5 skips every parameter named ``bn``, create_optimizer.py:11: not
exercised). Both sides: our ``resnet8_pft_mini`` + linear head, the same batches, fp32 on the CPU, each stage from
bit-identical inputs (their tensors adopt ours once compared, as tests/test_official_pfllib.py ``_adopt``).

Compared each round: what each client receives (the global model; from its second participation the personalised
model of its previous one, the teacher), the local update (every parameter and BatchNorm statistic after E epochs of
CE, or CE + λ·T²·KL(teacher ‖ student) with a train-mode teacher), the upload, the personalised model the server
keeps, the server's new global model, and the evaluation (logits of the personalised model, their ``validate``'s loss
and top-1, their mean over the clients), at λ = 0.5, T = 3 (ours) and λ = 1, T = 1 (their parser's defaults).

Differences, asserted as what they are (DEVIATIONS.md, pFedSD; fedcore/methods/pfedsd.py docstring):
* BatchNorm statistics of the global model: their server averages ``parameters()`` only into a copy of its own
  model (master_pFedSD.py:187-195), so the running statistics it sends stay the ones it started with (the initial
  ones) for the whole run; ours averages every state key (FedAvg's "average the model", as Fling's pFedSD and
  ``base_group``). Clients differ only in the running statistics they start a round from (training normalises by
  batch statistics), hence in their personalised models' statistics.
* Server weights: theirs 1/|S_t| (master_pFedSD.py:194), ours n_k/n (FedAvg's, Fling's); equal on clients of equal
  size (FedPFT's 500 each), shown here; on unequal ones theirs is the plain mean.
* Evaluation of a client that has not trained yet: theirs scores every client in round 1, an unselected one with its
  copy of the initial model, and after round 1 only the round's clients, keeping each other's last score
  (master_pFedSD.py:197-214); ours scores such a client with the current global model. Equal under full
  participation (FedPFT's pFedSD runs); a client that trained before scores the same on both sides (its unchanged
  personalised model).
* λ, T: their parser's defaults λ = 1, T = 1 (parameters.py:249, 251; their README's pFedSD command sets neither);
  ours 0.5 and 3, Fling's configs (FedPFT's authors' framework). Both settings are compared here.

Run: ``FEDPROMPT_PFEDSD_OFFICIAL=/tmp/pfedsd_official python -m pytest -n 0 tests/test_official_pfedsd.py`` (``-s``
prints the largest differences found).
"""
from __future__ import annotations

import copy
import functools
import importlib
import os
import sys
import warnings
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, Method, RoundInfo, module_state
from fedcore.methods.pfedsd import PFedSD
from fedcore.official_code import checkout_on_path, standin_modules
from official_support import assert_state_close as _close
from official_support import random_batches

ENV = "FEDPROMPT_PFEDSD_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a checkout of the "
                                "original pFedSD code (github.com/CGCL-codes/pFedSD) to compare our pFedSD against")

ARCH, CLASSES, BATCH, SIZE, LR, EPOCHS = "resnet8_pft_mini", 5, 8, 16, 0.05, 2
SGD = {"name": "sgd", "lr": LR, "momentum": 0.9, "weight_decay": 0.0}   # their README's SGD, FedPFT's no decay
NBT = "num_batches_tracked"
MODULES = {"worker": "pcode.workers.worker_pFedSD", "worker_base": "pcode.workers.worker_base",
           "master": "pcode.masters.master_pFedSD", "master_base": "pcode.masters.master_base",
           "create_model": "pcode.create_model", "metrics": "pcode.create_metrics",
           "coordinator": "pcode.create_coordinator", "cross_entropy": "pcode.utils.cross_entropy",
           "timer": "pcode.utils.timer", "parameters": "parameters"}
# the optimisation flags of their README's pFedSD command (lr, batch size, epochs, decay: ours, set per run)
README_FLAGS = ["--optimizer", "sgd", "--local_prox_term", "0", "--lr_warmup", "False", "--lr_warmup_epochs", "5",
                "--lr_warmup_epochs_upper_bound", "150", "--lr_scheduler", "MultiStepLR", "--lr_decay", "0.1",
                "--use_nesterov", "False", "--momentum_factor", "0.9", "--algo", "pFedSD", "--personal_test", "True"]


# ---- importing their code -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pfedsd() -> SimpleNamespace:
    """Their worker, master, model factory, metrics, coordinator, loss, timer and parameter modules."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "pcode" / "workers" / "worker_pFedSD.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of CGCL-codes/pFedSD (no pcode/workers/worker_pFedSD.py)")
    importlib.import_module("torchvision")   # their data sets import it; loaded once, outside the context
    standins = standin_modules({"lmdb": {}, "cv2": {}, "torchcontrib": {}})   # data loaders, an unused aggregator
    with checkout_on_path(root, ("pcode", "parameters"), standins), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # their evonorm ResNet's torch.jit.script, not used
        mods = {k: importlib.import_module(v) for k, v in MODULES.items()}
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return SimpleNamespace(**mods)


class Quiet:
    """Their ``Logger`` (a JSON and a text file in the checkpoint folder): discards everything."""

    def __getattr__(self, name: str) -> Any:
        """Any logging call: a no-op (``meet_cache_limit``: False)."""
        return lambda *args, **kwargs: False


class Wire:
    """``torch.distributed`` for their master (rank 0) and workers (1..n), run one after another in this process:
    a message is a copy queued per (sender, receiver), ``broadcast`` hands the master's tensor to the workers, a
    barrier has nothing to wait for. ``rank`` is the process now running (set before each worker's calls)."""

    def __init__(self) -> None:
        self.rank = 0
        self.queues: dict[tuple[int, int], deque] = defaultdict(deque)
        self.broadcasted: Tensor | None = None

    def send(self, tensor: Tensor, dst: int) -> None:
        """Queue a copy for ``dst``."""
        self.queues[(self.rank, dst)].append(tensor.detach().clone())

    def recv(self, tensor: Tensor, src: int) -> None:
        """The oldest message from ``src``, into ``tensor``."""
        tensor.copy_(self.queues[(src, self.rank)].popleft())

    def irecv(self, tensor: Tensor, src: int) -> SimpleNamespace:
        """``recv`` at once; a request whose ``wait`` has nothing left to do."""
        self.recv(tensor, src)
        return SimpleNamespace(wait=lambda: None)

    def broadcast(self, tensor: Tensor, src: int) -> None:
        """The sender's tensor kept; a receiver's filled with it."""
        if self.rank == src:
            self.broadcasted = tensor.clone()
        else:
            tensor.copy_(self.broadcasted)

    def barrier(self) -> None:
        """Nothing to wait for."""

    def empty(self) -> bool:
        """Every message sent has been received."""
        return not any(self.queues.values())


# ---- the shared setting ---------------------------------------------------------------------------------------
# ``n`` batches of BATCH random images (3 x SIZE x SIZE), labels from the classes not in ``missing``
_batches = functools.partial(random_batches, batch=BATCH, classes=CLASSES, size=SIZE)


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    settings = TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=dict(SGD))
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid),
                      settings=settings)


def _ours(lam: float, temp: float) -> Method:
    """Our pFedSD on ``resnet8_pft_mini`` (a seeded random draw) with a CLASSES-way head."""
    torch.manual_seed(0)
    return PFedSD(prompt_adapter(build_backbone(ARCH)), CLASSES, {"lam": lam, "temperature": temp})


def _fit(method: Method, cid: int, state: dict, downlink: dict, data: ClientData) -> tuple[dict, FitResult]:
    """Our client's round, its model in train mode as the engine leaves it."""
    method.model_for(cid).train()
    return method.client.fit(cid, state, downlink, data, data.settings)


def _state(model: nn.Module) -> dict[str, Tensor]:
    """Copies of a model's state tensors."""
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


def _same(ours: dict[str, Tensor], theirs: dict[str, Tensor], what: str, keys: list[str]) -> None:
    """Float tensors to fp32 tolerance, batch counters exactly."""
    _close(ours, theirs, what, _floats(keys))
    for k in keys:
        if k.endswith(NBT):
            assert torch.equal(ours[k], theirs[k].to(ours[k].dtype)), f"{what}, {k}"


def _conf(pfedsd: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, rank: int, n_clients: int, n_participated: int,
          lam: float, temp: float) -> Any:
    """Their ``conf``: their parser on the README's flags with ours, plus what their ``init_config`` adds (graph,
    parsed ``fl_aggregate``, logger)."""
    argv = ["main.py", *README_FLAGS, "--lr", str(LR), "--batch_size", str(BATCH), "--local_n_epochs", str(EPOCHS),
            "--weight_decay", "0", "--lamda", str(lam), "--KL_T", str(temp), "--n_clients", str(n_clients),
            "--n_participated", str(n_participated)]
    monkeypatch.setattr(sys, "argv", argv)
    conf = pfedsd.parameters.get_args()
    conf.graph = SimpleNamespace(rank=rank, worker_id=rank, on_cuda=False, n_nodes=n_participated + 1, comm_round=0,
                                 client_id=None)
    conf.fl_aggregate = {"scheme": "federated_average"}
    conf.logger = Quiet()
    return conf


class Federation:
    """Their master and workers around our initial model, driven call for call as their ``run`` loops."""

    def __init__(self, pfedsd: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, method: Method,
                 data: dict[int, list], tests: dict[int, list], n_participated: int, lam: float, temp: float) -> None:
        self.wire = Wire()
        for mod in (pfedsd.worker, pfedsd.worker_base, pfedsd.master, pfedsd.master_base):
            monkeypatch.setattr(mod, "dist", self.wire)
        template = copy.deepcopy(method.model_for(1)).train()   # our initial model
        monkeypatch.setattr(pfedsd.create_model, "define_model",
                            lambda conf, **kw: ("ours", copy.deepcopy(template)))
        monkeypatch.setattr(pfedsd.master.checkpoint, "save_arguments", lambda conf: None)   # writes files
        n = len(data)

        def master_base_init(master: Any, conf: Any) -> None:
            """MasterBase.__init__'s fields, without data sets: our model, our test batches (ids 1..n)."""
            master.conf, master.client_ids = conf, list(range(1, 1 + n))
            master.world_ids = list(range(1, 1 + n_participated))
            master.master_model = copy.deepcopy(template)
            master.client_models = {"ours": copy.deepcopy(template)}
            master.clientid2arch = conf.clientid2arch = {c: "ours" for c in master.client_ids}
            master.local_test_loaders = {c: tests[c] for c in master.client_ids}
            master.criterion = pfedsd.cross_entropy.CrossEntropyLoss(reduction="mean")
            master.metrics = pfedsd.metrics.Metrics(master.master_model, task="classification")
            master.client_coordinators = {c: pfedsd.coordinator.Coordinator(conf, master.metrics)
                                          for c in master.client_ids}
            master.curr_personal_perfs = {}
            master.personal_avg_coordinator = pfedsd.coordinator.Coordinator(conf, master.metrics)

        def worker_base_init(worker: Any, conf: Any) -> None:
            """WorkerBase.__init__'s fields, without the data set and the process group."""
            worker.conf, worker.client_ids, worker.rank = conf, list(range(1, 1 + n)), conf.graph.rank
            worker.device = torch.device("cpu")
            worker.timer = pfedsd.timer.Timer(verbosity_level=0, log_fn=conf.logger.log_metric)
            worker.criterion = nn.CrossEntropyLoss(reduction="mean")

        def local_loader(worker: Any) -> None:
            """Our batches of the worker's client, in our order; the count their loader factory sets."""
            worker.train_loader = data[worker.conf.graph.client_id]
            worker.conf.num_batches_per_device_per_epoch = len(worker.train_loader)

        monkeypatch.setattr(pfedsd.master_base.MasterBase, "__init__", master_base_init)
        monkeypatch.setattr(pfedsd.worker_base.WorkerBase, "__init__", worker_base_init)
        monkeypatch.setattr(pfedsd.worker_base.WorkerBase, "prepare_local_train_loader", local_loader)
        self.master = pfedsd.master.MasterpFedSD(_conf(pfedsd, monkeypatch, 0, n, n_participated, lam, temp))
        self.workers = {}
        for rank in range(1, 1 + n_participated):
            self.wire.rank = rank
            self.workers[rank] = pfedsd.worker.WorkerpFedSD(
                _conf(pfedsd, monkeypatch, rank, n, n_participated, lam, temp))
        self.wire.rank = 0

    def start_round(self, r: int, selected: list[int]) -> dict[int, Any]:
        """Master: activate and send; workers: listen and receive. The worker of each selected client (1..n)."""
        m = self.master
        m.conf.graph.comm_round = r
        m._activate_selected_clients(selected, r, [EPOCHS] * len(selected))
        by_client = {}
        for rank, worker in self.workers.items():
            self.wire.rank = rank
            worker._listen_to_master()
            by_client[worker.conf.graph.client_id] = worker
        self.wire.rank = 0
        m._send_model_to_selected_clients(selected)
        for rank, worker in self.workers.items():
            self.wire.rank = rank
            worker._recv_model_from_master()
        self.wire.rank = 0
        return by_client

    def train(self, worker: Any) -> None:
        """A worker's local round (their run: ``_train`` at the first participation, else ``_train_AKT``) and its
        upload."""
        self.wire.rank = worker.conf.graph.rank
        worker._train() if worker.is_active_before == 0 else worker._train_AKT()
        worker._send_model_to_master()
        self.wire.rank = 0

    def finish_round(self, selected: list[int]) -> None:
        """Master: receive, keep the personalised models, aggregate, evaluate (their run's order)."""
        m = self.master
        flat = m._receive_models_from_selected_clients(selected)
        m.activated_ids.update(selected)
        m.update_local_models(selected, flat)
        m._aggregate_model(selected)
        m._update_client_performance(selected)
        assert self.wire.empty()


def _scores(method: Method, cid: int, state: dict, client_state: dict, test: list) -> Tensor:
    """Our evaluator's logits for client ``cid`` on its test batches (model loaded, eval mode)."""
    model = method.model_for(cid)
    method.evaluator.load(model, cid, state, client_state, None)
    model.eval()
    return torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {})) for x, y in test])


def _check_scores(perf: Any, logits: Tensor, test: list, what: str) -> None:
    """Their ``validate`` (batch-weighted CE, top-1 in %; a ``MathDict``) equals ours from our logits."""
    perf, y = perf.dictionary, torch.cat([b[1] for b in test])
    assert perf["top1"] == pytest.approx(100 * float((logits.argmax(1) == y).float().mean()), abs=1e-9), what
    assert perf["loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5), what


def _run(pfedsd: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, lam: float, temp: float,
         data: dict[int, list], selections: list[list[int]], n_participated: int) -> None:
    """Both sides over ``selections`` (client ids 1..n; ours 0..n-1), every stage compared; the documented
    differences asserted where they show."""
    method = _ours(lam, temp)
    keys = method.keys(0)
    params = method.trainable_keys(0)
    buffers = [k for k in keys if k not in params]
    tests = {c: _batches(2, 90 + c) for c in data}
    fed = Federation(pfedsd, monkeypatch, method, data, tests, n_participated, lam, temp)
    initial = _state(fed.master.master_model)
    state, states = method.strategy.init_state(len(data)), {c: method.client.init_state(c - 1) for c in data}
    trained: set[int] = set()
    scores: dict[int, Tensor] = {}
    for r, selected in enumerate(selections, start=1):
        workers = fed.start_round(r, selected)
        results = []
        for c in selected:
            worker = workers[c]
            # what the client receives: the global model, and from its second participation its teacher
            _same(state["model"], _state(worker.model), f"round {r} client {c} global model received", keys)
            assert worker.is_active_before == (c in trained)
            if c in trained:
                _same(states[c]["model"], _state(worker.last_local_model), f"round {r} client {c} teacher", keys)
                assert worker.last_local_model.training   # their teacher: a copy of the model in train mode
            fed.train(worker)
            states[c], res = _fit(method, c - 1, states[c], method.strategy.configure(state, c - 1),
                                  _data(c - 1, data[c]))
            results.append(res)
            ours = module_state(method.model_for(c - 1), keys)
            _same(ours, _state(worker.model), f"round {r} client {c} local update", keys)
            assert set(res.uplink["model"]) == set(keys)   # the whole model, as their worker sends its state
        uploads = {c: res.uplink["model"] for c, res in zip(selected, results)}
        before = _state(fed.master.master_model)
        fed.finish_round(selected)
        trained |= set(selected)
        for c in selected:
            kept = _state(fed.master.local_models[c])
            _same(uploads[c], kept, f"round {r} client {c} upload", keys)
            _same(states[c]["model"], kept, f"round {r} client {c} personalised model", keys)
        state = method.strategy.aggregate(RoundInfo(r, len(data), len(selected) / len(data), 0), state, results)
        glob = _state(fed.master.master_model)
        sizes = {c: sum(len(y) for _, y in data[c]) for c in selected}
        plain = {k: sum(uploads[c][k] for c in selected) / len(selected) for k in _floats(params)}
        _close(plain, glob, f"round {r} their server: the plain mean of the parameters", _floats(params))
        weighted = {k: sum(sizes[c] * uploads[c][k] for c in selected) / sum(sizes.values()) for k in keys}
        _close(state["model"], weighted, f"round {r} our server: the n_k/n mean of every key", _floats(keys))
        if len(set(sizes.values())) == 1:   # equal sizes: 1/|S| = n_k/n
            _close(state["model"], glob, f"round {r} server average", _floats(params))
        else:   # documented: theirs the plain mean, ours sample-weighted
            assert all(not torch.allclose(state["model"][k], glob[k], rtol=1e-4, atol=1e-5) for k in params), r
        # documented: their server never writes its BatchNorm statistics (the initial ones, as long as they are
        # not adopted); ours are the average of the uploads'
        assert all(torch.equal(glob[k], before[k]) for k in buffers)
        if r == 1:
            assert all(torch.equal(glob[k], initial[k]) for k in buffers)
        moved = [k for k in _floats(buffers) if not torch.allclose(state["model"][k], glob[k], rtol=1e-3, atol=1e-4)]
        assert moved, "our averaged running statistics should differ from their server's"
        _adopt(fed.master.master_model, state["model"])
        for c in selected:
            _adopt(fed.master.local_models[c], states[c]["model"])
        # the evaluation: their round 1 scores every client, later rounds the round's clients
        evaluated = set(data) if r == 1 else set(selected)
        for c in data:
            perf = fed.master.curr_personal_perfs[c]
            logits = _scores(method, c - 1, state, states[c], tests[c])
            if c in trained:
                if c in selected:
                    with torch.no_grad():
                        theirs = fed.master.local_models[c].eval()(torch.cat([x for x, _ in tests[c]]))
                    _close({"logits": logits}, {"logits": theirs}, f"round {r} client {c} logits")
                    scores[c] = logits
                _check_scores(perf, scores[c], tests[c], f"round {r} client {c} scores")   # theirs: kept
                torch.testing.assert_close(logits, scores[c], rtol=0, atol=0)   # ours: the same model again
            else:   # documented: theirs the initial model's score from round 1, ours the current global model
                assert r == 1 and c in evaluated
                first = _scores(method, c - 1, {"model": initial}, {}, tests[c])
                _check_scores(perf, first, tests[c], f"round {r} client {c} (not trained): their initial model")
                assert not torch.allclose(first, logits, rtol=1e-3, atol=1e-3)
                with torch.no_grad():
                    glob_logits = fed.master.master_model.eval()(torch.cat([x for x, _ in tests[c]]))
                _close({"logits": logits}, {"logits": glob_logits}, f"round {r} client {c}: our global model")
        # their reported figure: the plain mean over the clients of each one's latest top-1
        mean = fed.master.personal_avg_coordinator.key_metric.cur_perf
        latest = [fed.master.curr_personal_perfs[c].dictionary["top1"] for c in data]
        assert mean == pytest.approx(sum(latest) / len(data))


# ---- the rounds -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lam, temp", [(0.5, 3.0), (1.0, 1.0)], ids=["ours-0.5-3", "theirs-1-1"])
def test_full_participation_local_update_teacher_server_step_and_personalised_evaluation(pfedsd, monkeypatch, lam,
                                                                                         temp):
    """3 clients of equal size, all every round (FedPFT's setting), 3 rounds: round 1 CE only, rounds 2-3
    distilled from the previous personalised model; every stage equal but the global BatchNorm statistics."""
    data = {1: _batches(3, 20, missing=(4,)), 2: _batches(3, 21, missing=(0, 1)), 3: _batches(3, 22)}
    _run(pfedsd, monkeypatch, lam, temp, data, [[1, 2, 3]] * 3, 3)


def test_partial_participation_unequal_clients(pfedsd, monkeypatch):
    """3 clients of unequal size, 2 a round ({1,2}, {2,3}, {1,3}): the teacher only from a client's second
    participation, their 1/|S| mean against our n_k/n, and the score of a client that has not trained yet."""
    data = {1: _batches(3, 30, missing=(4,)), 2: _batches(2, 31, missing=(0, 1)), 3: _batches(4, 32)}
    _run(pfedsd, monkeypatch, 0.5, 3.0, data, [[1, 2], [2, 3], [1, 3]], 2)


def test_their_defaults_are_lambda_1_and_temperature_1(pfedsd, monkeypatch):
    """Their parser's λ and T (parameters.py:249, 251; their README's pFedSD command sets neither) against ours
    (Fling's λ = 0.5, T = 3, documented)."""
    monkeypatch.setattr(sys, "argv", ["main.py"])
    conf = pfedsd.parameters.get_args()
    assert (conf.lamda, conf.KL_T) == (1.0, 1.0)
    assert (PFedSD.defaults["lam"], PFedSD.defaults["temperature"]) == (0.5, 3.0)
