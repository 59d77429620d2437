"""pFedPT against the official code (github.com/hkgdifyu/pFedPT, HEAD), number for number, on the CPU in fp32.

Opt-in: ``FEDPROMPT_PFEDPT_OFFICIAL`` names a checkout of hkgdifyu/pFedPT (``git archive HEAD``). Its
``system/flcore/trainmodel/models.py`` (``PadPrompter``, ``VisionTransformer``, ``LocalModel_pt``),
``clients/clientpt.py`` (``clientPT``) and ``servers/serverpfedpt.py`` (``PFedPT``) are imported from there at test
time; nothing of it is copied here. CI has no checkout and no internet: every test skips there.

    FEDPROMPT_PFEDPT_OFFICIAL=/tmp/pfedpt_official python -m pytest -n 0 tests/test_official_pfedpt.py

Both sides hold the SAME model: our ``vit_pfedpt_mini`` pFedPT (16 px, pad width 2, dim 32, 4 blocks, 2 heads, MLP
ratio 2) is copied into their ``LocalModel_pt(PadPrompter, VisionTransformer)`` at the same sizes (our names ->
theirs: ``official_state``), so their prompt and ViT code run on our tensors. Their clients read our fixed batches
(``load_train_data`` / ``load_test_data`` overridden), with their argparse defaults where the method is concerned:
prompt SGD lr 20, momentum 0.5 (kept across rounds), StepLR gamma 1; ViT + head plain SGD lr 0.05. Compared over
two rounds of two clients (of unequal size): the prompted input, each client's prompt after stage 1 and its ViT +
head after stage 2 (``clientPT.train``), the server's sample-weighted average (``receive_models`` /
``aggregate_parameters``), and each client's personalised prediction (its own prompt + the global ViT and head,
their ``test_metrics`` after ``send_models``). Every stage starts from bit-identical tensors (their server adopts
our global model once compared: the official ViT's attention and ours round differently, and the prompt's lr of
20 would amplify that over rounds).

The ResNet variant (FedPFT's ``pft_pfedpt``, ``arch: experiment``): our pFedPT on ``resnet8_pft_mini`` (pad width
2 at 16 px) with a copy of our extractor and head as their ``LocalModel_pt``'s base (``ResNetBase``: their wrapper
takes any model) behind their ``PadPrompter``; the same two rounds, comparing the prompted input and logits (train
and eval mode), the prompt after stage 1 (BatchNorm in train mode, its statistics moving), the extractor + head
after stage 2, the BatchNorm statistics, the server's average and the personalised logits. One difference, kept
and asserted exactly: their server moves ``parameters()`` only (``clientpt.py:97-100``, ``serverbase.py:115-127``),
so each of their clients keeps its own BatchNorm statistics (never sent, never averaged; their global copy holds
the first uploader's) and is scored with them, while ours are averaged with the model (Fling's state-dict FedAvg).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.machinery
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from fedcore.backbones.prompted import attention_backend
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import RoundInfo
from fedcore.methods.pfedpt import PFedPT
from fedcore.official_code import checkout_on_path

ENV = "FEDPROMPT_PFEDPT_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a local checkout of "
                                "github.com/hkgdifyu/pFedPT (none in CI, which has no internet)")

RTOL, ATOL = 1e-5, 1e-6                  # fp32 on the CPU
SIDE, PATCH, DIM, DEPTH, HEADS, MLP = 16, 4, 32, 4, 2, 2.0   # vit_pfedpt_mini
CLASSES, BATCH, PAD = 4, 8, 2
PROMPT_EPOCHS, LOCAL_EPOCHS = 3, 2       # their plocal_steps and local_steps (5 and 5 by default; fewer: speed)
PROMPT_LR, MOMENTUM, LR = 20.0, 0.5, 0.05   # their argparse defaults (main.py: pt_learning_rate, momentum, -lr)
SIZES = (24, 16)
VERBOSE = bool(os.environ.get("FEDPROMPT_VERBOSE"))   # every comparison's differences (with -s)
THEIR_PACKAGES = ("flcore", "utils", "sklearn", "h5py", "ujson", "transformers")
#: our prompt's names -> PadPrompter's
PROMPT_NAMES = {"top": "pad_up", "bottom": "pad_down", "left": "pad_left", "right": "pad_right"}
#: our net / head prefixes -> LocalModel_pt's: their VisionTransformer holds its head as ``fc``
VIT_LAYOUT = {"net": "base.", "head": "base.fc."}


# ---- importing the official code ---------------------------------------------------------------------------------
class MetricsStandIn(ModuleType):
    """``sklearn.metrics`` for their ``test_metrics``: records the scores it is given (a client's logits)."""

    def __init__(self) -> None:
        super().__init__("sklearn.metrics")
        self.scored: list[np.ndarray] = []

    def roc_auc_score(self, y_true: np.ndarray, y_prob: np.ndarray, average: str = "micro") -> float:
        """Record ``y_prob``; 0.5."""
        self.scored.append(np.asarray(y_prob))
        return 0.5


def _label_binarize(y: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """One-hot rows (what their metrics code passes to the AUC, unused here)."""
    return (np.asarray(y)[:, None] == np.asarray(classes)[None, :]).astype(int)


def _standins(metrics: MetricsStandIn) -> dict[str, ModuleType]:
    """Modules only their harness needs (metrics, result files, data files, a Hugging Face ViT they never build)."""
    mods = {n: ModuleType(n) for n in ("sklearn", "sklearn.preprocessing", "h5py", "ujson", "transformers")}
    mods["sklearn.metrics"] = metrics
    mods["sklearn.preprocessing"].label_binarize = _label_binarize
    mods["sklearn"].metrics, mods["sklearn"].preprocessing = metrics, mods["sklearn.preprocessing"]
    mods["transformers"].ViTImageProcessor = mods["transformers"].ViTForImageClassification = None
    return mods


def _official_on_path(system: Path, metrics: MetricsStandIn) -> contextlib.AbstractContextManager[None]:
    """Their ``system`` folder first on sys.path with the stand-ins (their generic top-level names must
    not leak into other tests)."""
    return checkout_on_path(system, THEIR_PACKAGES, _standins(metrics))


@pytest.fixture(scope="module")
def official() -> SimpleNamespace:
    """Their models, clientpt and serverpfedpt / serverbase modules and the metrics stand-in."""
    system = Path(os.environ[ENV]).resolve() / "system"
    if not (system / "flcore" / "clients" / "clientpt.py").is_file():
        pytest.fail(f"{ENV}={system.parent} is not a checkout of hkgdifyu/pFedPT (no system/flcore/clients/"
                    "clientpt.py)")
    metrics = MetricsStandIn()
    names = {"models": "flcore.trainmodel.models", "client": "flcore.clients.clientpt",
             "server": "flcore.servers.serverpfedpt", "base": "flcore.servers.serverbase"}
    with _quiet():
        importlib.import_module("timm.models.layers")   # theirs imports it (a real dependency), before the stand-ins
    with _official_on_path(system, metrics), _quiet():
        mods = {k: importlib.import_module(v) for k, v in names.items()}
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(system), f"imported {mod.__file__}, not from {system}"
    return SimpleNamespace(metrics=metrics, **mods)


@contextmanager
def _quiet() -> Iterator[None]:
    """Their ``timm.models.layers`` import warns that the path is deprecated (their code, not ours)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


# ---- the shared model and data -----------------------------------------------------------------------------------
def official_state(ours: dict[str, Tensor], layout: dict[str, str] | None = None) -> dict[str, Tensor]:
    """Our pFedPT state under LocalModel_pt's names (prompt.<side> -> generator.pad_<...>; net and head as
    ``layout`` says: the ViT's by default)."""
    layout = VIT_LAYOUT if layout is None else layout
    out = {}
    for k, v in ours.items():
        head, _, rest = k.partition(".")
        name = f"generator.{PROMPT_NAMES.get(rest, rest)}" if head == "prompt" else f"{layout[head]}{rest}"
        out[name] = v.detach().clone()
    return out


def _ours() -> PFedPT:
    """Our pFedPT on vit_pfedpt_mini (a seeded random draw), the official prompt optimiser and epochs."""
    torch.manual_seed(0)
    return PFedPT(prompt_adapter(build_backbone("vit_pfedpt_mini")), CLASSES,
                  {"arch": "vit_pfedpt_mini", "pad_width": PAD, "prompt_epochs": PROMPT_EPOCHS,
                   "prompt_lr": PROMPT_LR, "prompt_momentum": MOMENTUM, "local_epochs": LOCAL_EPOCHS})


def _namespace() -> SimpleNamespace:
    """Their argparse namespace (main.py's defaults where the method reads them), without a model."""
    return SimpleNamespace(
        device="cpu", dataset="none", global_rounds=2, local_steps=LOCAL_EPOCHS, batch_size=BATCH,
        local_learning_rate=LR, num_clients=len(SIZES), join_ratio=1.0, algorithm="PFedPT", time_select=False,
        goal="test", time_threthold=10000, save_folder_name="unused", num_prompt=PAD, plocal_steps=PROMPT_EPOCHS,
        eval_gap=1, client_drop_rate=0.0, train_slow_rate=0.0, send_slow_rate=0.0, num_classes=CLASSES,
        privacy=False, dp_sigma=0.0, pt_learning_rate=PROMPT_LR, momentum=MOMENTUM, learning_decay=1.0)


def _args(official: SimpleNamespace, method: PFedPT) -> SimpleNamespace:
    """Their argparse namespace with their model at our sizes holding our tensors."""
    args = _namespace()
    m = official.models
    generator = m.PadPrompter(inchanel=3, pad_size=PAD, image_size=SIDE, args=args)
    base = m.VisionTransformer(img_size=SIDE, patch_size=PATCH, in_chans=3, num_classes=CLASSES, embed_dim=DIM,
                               depth=DEPTH, num_heads=HEADS, mlp_ratio=MLP, qkv_bias=True)
    args.model = m.LocalModel_pt(generator, base)
    args.model.load_state_dict(official_state(method.model.state_dict()), strict=True)   # every tensor named once
    return args


def _their_client(official: SimpleNamespace, args: SimpleNamespace, cid: int, train: list, test: list) -> Any:
    """Their clientPT whose loaders return our fixed batches in order (theirs read .npz files and shuffle)."""
    class Driven(official.client.clientPT):
        """clientPT fed by fixed batches."""

        def load_train_data(self, batch_size: int | None = None) -> list:
            """The fixed training batches."""
            return list(train)

        def load_test_data(self, batch_size: int | None = None) -> list:
            """The fixed test batches."""
            return list(test)

    return Driven(args, id=cid, train_samples=sum(len(y) for _, y in train), test_samples=len(test),
                  train_slow=False, send_slow=False)


def _their_server(official: SimpleNamespace, args: SimpleNamespace, clients: list) -> Any:
    """Their PFedPT server with ``clients``, all selected: ``Server.__init__`` and PFedPT's global model (its own
    __init__ reads every client's data files)."""
    server = official.server.PFedPT.__new__(official.server.PFedPT)
    official.base.Server.__init__(server, args, 0)
    server.args, server.global_model = args, copy.deepcopy(args.model.base)
    server.clients, server.selected_clients = list(clients), list(clients)
    return server


def _batches(n: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """A client's fixed batches of BATCH images (model-ready, mean = std = 0.5 scale) and labels."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, SIDE, SIDE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return [(x[s:s + BATCH], y[s:s + BATCH]) for s in range(0, n, BATCH)]


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid))


def _close(ours: dict[str, Tensor], theirs: dict[str, Tensor], what: str,
           layout: dict[str, str] | None = None) -> None:
    """Every tensor of ``ours`` against theirs (official names) within fp32 tolerance; the worst differences."""
    worst_abs = worst_rel = 0.0
    mapped = official_state(ours, layout)
    for k, a in mapped.items():
        a, b = a.double(), theirs[k].detach().double()
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{what}, {k}: {m}")
        diff = (a - b).abs()
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff / b.abs().clamp_min(1e-3)).max()))
    if VERBOSE:
        print(f"{what}: {len(mapped)} tensors, max abs {worst_abs:.2e}, max rel {worst_rel:.2e}")


def _close_tensor(a: Tensor, b: Tensor, what: str) -> None:
    """One tensor against theirs within fp32 tolerance."""
    torch.testing.assert_close(a.double(), b.double(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    if VERBOSE:
        print(f"{what}: max abs {float((a.double() - b.double()).abs().max()):.2e}")


# ---- the tests ---------------------------------------------------------------------------------------------------
def test_prompted_input_and_logits_equal_the_official(official):
    """The same tensors give the same prompted image (x + frame, zero inside) and the same logits."""
    method = _ours()
    theirs = _args(official, method).model
    x = _batches(BATCH, 3)[0][0]
    with torch.no_grad(), attention_backend("cpu"):
        ours_in, their_in = method.model.prompt(x), theirs.generator(x)
        assert torch.equal(ours_in, their_in)             # the same additions, bit for bit
        assert torch.equal(ours_in[:, :, PAD:-PAD, PAD:-PAD], x[:, :, PAD:-PAD, PAD:-PAD])
        _close_tensor(method.model(x), theirs(x), "logits")


def test_two_rounds_of_both_stages_aggregation_and_personal_prediction_equal_the_official(official):
    """Two rounds, two clients: stage 1 (prompt, kept momentum), stage 2 (ViT + head), the server's average, and
    each client's prediction with its own prompt and the global ViT + head."""
    method = _ours()
    args = _args(official, method)
    data = {c: _batches(n, 20 + c) for c, n in enumerate(SIZES)}
    test = _batches(BATCH, 99)
    clients = [_their_client(official, args, c, data[c], test) for c in data]
    server = _their_server(official, args, clients)
    settings = TrainSettings(local_epochs=9, batch_size=BATCH, optimizer={"name": "sgd", "lr": LR})  # param wins
    info = RoundInfo(round=0, num_clients=len(SIZES), participation=1.0, seed=0)
    ours_server = method.strategy.init_state(len(SIZES))
    states = {c: method.client.init_state(c) for c in data}
    prompt_keys = [k for k in method.model.state_dict() if k.startswith("prompt.")]

    for r in (1, 2):
        server.send_models()   # every client's ViT + head := the global (round 1: the initial model)
        results = []
        for c, client in enumerate(clients):
            with attention_backend("cpu"):
                method.model_for(c).train()
                states[c], res = method.client.fit(c, states[c], method.strategy.configure(ours_server, c),
                                                   _data(c, data[c]), settings)
                client.train()
            results.append(res)
            their = client.model.state_dict()
            _close(states[c]["model"], their, f"round {r} client {c} prompt (stage 1)")
            _close(res.uplink["model"], their, f"round {r} client {c} ViT + head (stage 2)")
            # the prompt's momentum buffers, kept across rounds on both sides
            kept = states[c]["optimizer"]["state"]
            _close({k: kept[i]["momentum_buffer"] for i, k in enumerate(prompt_keys)},
                   {f"generator.{PROMPT_NAMES[k[7:]]}": client.poptimizer.state[
                       getattr(client.model.generator, PROMPT_NAMES[k[7:]])]["momentum_buffer"] for k in prompt_keys},
                   f"round {r} client {c} prompt momentum")
            start = method.strategy.configure(ours_server, c)["model"]
            assert all(float((res.uplink["model"][k] - start[k]).abs().max()) > 1e-4 for k in ("head.weight",
                                                                                                 "net.pos_embed"))
        ours_server = method.strategy.aggregate(info, ours_server, results)
        server.receive_models()
        server.aggregate_parameters()
        _close(ours_server["model"], {f"base.{k}": v for k, v in server.global_model.state_dict().items()},
               f"round {r} global ViT + head")
        with torch.no_grad():   # the next stage from bit-identical tensors
            server.global_model.load_state_dict({k[5:]: v for k, v in official_state(ours_server["model"]).items()})

        # personalised prediction: their test_metrics after send_models (own prompt + global base) against ours
        server.send_models()
        model = method.model.eval()
        for c, client in enumerate(clients):
            official.metrics.scored.clear()
            with attention_backend("cpu"):
                client.test_metrics()
                method.evaluator.load(model, c, ours_server, states[c], None)
                logits = torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {}))
                                    for x, y in test])
            _close_tensor(logits, torch.from_numpy(official.metrics.scored[0]),
                          f"round {r} client {c} personalised logits")


# ---- the ResNet variant (FedPFT's pft_pfedpt: arch experiment) ---------------------------------------------------
#: our net / head prefixes -> the ResNet base's names inside LocalModel_pt
RESNET_LAYOUT = {"net": "base.net.", "head": "base.head."}
BN_MOMENTUM = 0.1   # torch's BatchNorm default, which StemResNet keeps (asserted)


class ResNetBase(nn.Module):
    """Their ``LocalModel_pt``'s base for FedPFT's setting: a copy of our extractor and linear head (pooled
    feature -> logits), as any PFLlib model they would wrap."""

    def __init__(self, net: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.net, self.head = copy.deepcopy(net), copy.deepcopy(head)

    def forward(self, x: Tensor) -> Tensor:
        """Logits."""
        return self.head(self.net(x))


def _ours_resnet() -> PFedPT:
    """Our pFedPT on the experiment's resnet8_pft_mini (a seeded random draw: FedPFT trains it from scratch)."""
    torch.manual_seed(0)
    return PFedPT(prompt_adapter(build_backbone("resnet8_pft_mini")), CLASSES,
                  {"arch": "experiment", "pad_width": PAD, "prompt_epochs": PROMPT_EPOCHS, "prompt_lr": PROMPT_LR,
                   "prompt_momentum": MOMENTUM, "local_epochs": LOCAL_EPOCHS})


def _args_resnet(official: SimpleNamespace, method: PFedPT) -> SimpleNamespace:
    """Their namespace with ``LocalModel_pt(PadPrompter, ResNetBase)`` holding our tensors."""
    args = _namespace()
    generator = official.models.PadPrompter(inchanel=3, pad_size=PAD, image_size=SIDE, args=args)
    args.model = official.models.LocalModel_pt(generator, ResNetBase(method.model.net, method.model.head))
    args.model.load_state_dict(official_state(method.model.state_dict(), RESNET_LAYOUT), strict=True)
    return args


def _split(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A state's BatchNorm buffers (running_mean / running_var / num_batches_tracked) and the rest."""
    def is_buffer(k: str) -> bool:
        return k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    return ({k: v for k, v in state.items() if is_buffer(k)}, {k: v for k, v in state.items() if not is_buffer(k)})


def _to_ours(theirs: dict[str, Tensor], keys: list[str]) -> dict[str, Tensor]:
    """Their base's tensors under our names (for ``keys``)."""
    names = official_state({k: torch.zeros(()) for k in keys}, RESNET_LAYOUT)
    return {k: theirs[n].detach().clone() for k, n in zip(keys, names)}


def test_resnet_prompted_input_and_logits_equal_the_official(official):
    """On the experiment's ResNet the same tensors give the same prompted image and logits (train and eval mode)."""
    method = _ours_resnet()
    theirs = _args_resnet(official, method).model
    assert all(m.momentum == BN_MOMENTUM for m in method.model.modules() if isinstance(m, nn.BatchNorm2d))
    x = _batches(BATCH, 3)[0][0]
    with torch.no_grad():
        ours_in, their_in = method.model.prompt(x), theirs.generator(x)
        assert torch.equal(ours_in, their_in)
        assert torch.equal(ours_in[:, :, PAD:-PAD, PAD:-PAD], x[:, :, PAD:-PAD, PAD:-PAD])
        for train in (False, True):   # eval: running statistics; train: the batch's (and both move them)
            method.model.train(train), theirs.train(train)
            assert torch.equal(method.model(x), theirs(x))
        _close(method.model.state_dict(), theirs.state_dict(), "statistics after one train-mode pass", RESNET_LAYOUT)


def test_resnet_two_rounds_equal_the_official_but_for_batchnorm_statistics(official):
    """Two rounds, two clients on the experiment's ResNet: stage 1 (prompt; BatchNorm in train mode, statistics
    moving), stage 2 (extractor + head), the server's average and each client's personalised logits equal the
    official number for number, except the documented BatchNorm statistics: their server moves ``parameters()``
    only (clientpt.py:97-100, serverbase.py:115-127), so each of their clients keeps its own running statistics
    while ours are averaged with the model (Fling's state-dict FedAvg)."""
    method = _ours_resnet()
    args = _args_resnet(official, method)
    data = {c: _batches(n, 20 + c) for c, n in enumerate(SIZES)}
    test = _batches(BATCH, 99)
    clients = [_their_client(official, args, c, data[c], test) for c in data]
    server = _their_server(official, args, clients)
    settings = TrainSettings(local_epochs=9, batch_size=BATCH, optimizer={"name": "sgd", "lr": LR})  # param wins
    info = RoundInfo(round=0, num_clients=len(SIZES), participation=1.0, seed=0)
    ours_server = method.strategy.init_state(len(SIZES))
    states = {c: method.client.init_state(c) for c in data}
    prompt_keys = [k for k in method.model.state_dict() if k.startswith("prompt.")]
    shared_keys = [k for k in method.model.state_dict() if not k.startswith("prompt.")]
    weights = [n / sum(SIZES) for n in SIZES]

    for r in (1, 2):
        server.send_models()   # every client's parameters := the global's; their BatchNorm statistics stay
        results, uploads = [], []
        for c, client in enumerate(clients):
            start = method.strategy.configure(ours_server, c)["model"]
            ours_start, _ = _split(start)
            their_start, _ = _split(_to_ours(client.model.state_dict(), shared_keys))
            if r == 1:   # both sides start from the initial statistics
                assert all(torch.equal(ours_start[k], their_start[k]) for k in ours_start)
            else:        # ours: the average; theirs: the client's own from round 1
                assert max(float((ours_start[k] - their_start[k]).abs().max()) for k in ours_start) > 1e-3
            method.model_for(c).train()
            states[c], res = method.client.fit(c, states[c], method.strategy.configure(ours_server, c),
                                               _data(c, data[c]), settings)
            client.train()
            results.append(res)
            their = client.model.state_dict()
            _close(states[c]["model"], their, f"round {r} client {c} prompt (stage 1)", RESNET_LAYOUT)
            ours_stats, ours_params = _split(res.uplink["model"])
            _close(ours_params, their, f"round {r} client {c} extractor + head (stage 2)", RESNET_LAYOUT)
            # Statistics: the same K = (prompt + local epochs) x batches train-mode passes on both sides (stage 1
            # included: eval mode there would give fewer), each an EMA step linear in the start, so ours minus
            # theirs is the start's difference times (1 - m)^K: zero in round 1.
            passes = (PROMPT_EPOCHS + LOCAL_EPOCHS) * len(data[c])
            decay = (1 - BN_MOMENTUM) ** passes
            expected = {k: v - (1 if k.endswith("num_batches_tracked") else decay) * (ours_start[k] - their_start[k])
                        for k, v in ours_stats.items()}
            _close(expected, their, f"round {r} client {c} BatchNorm statistics (own start)", RESNET_LAYOUT)
            assert all(int(v) == int(ours_start[k]) + passes for k, v in ours_stats.items()
                       if k.endswith("num_batches_tracked"))
            kept = states[c]["optimizer"]["state"]
            _close({k: kept[i]["momentum_buffer"] for i, k in enumerate(prompt_keys)},
                   {f"generator.{PROMPT_NAMES[k[7:]]}": client.poptimizer.state[
                       getattr(client.model.generator, PROMPT_NAMES[k[7:]])]["momentum_buffer"] for k in prompt_keys},
                   f"round {r} client {c} prompt momentum", RESNET_LAYOUT)
            assert all(float((res.uplink["model"][k] - start[k]).abs().max()) > 1e-4
                       for k in ("head.weight", "net.conv1.weight", "net.bn1.running_mean"))
            uploads.append(_to_ours(their, shared_keys))
        ours_server = method.strategy.aggregate(info, ours_server, results)
        server.receive_models()
        server.aggregate_parameters()
        global_theirs = {f"base.{k}": v for k, v in server.global_model.state_dict().items()}
        ours_stats, ours_params = _split(ours_server["model"])
        _close(ours_params, global_theirs, f"round {r} global extractor + head (parameters)", RESNET_LAYOUT)
        # the documented difference: their global statistics are the first uploader's copy (aggregate_parameters
        # deep-copies uploaded_models[0] and averages parameters() only, serverbase.py:118-127); ours the average
        their_stats, _ = _split(_to_ours(global_theirs, shared_keys))
        assert all(torch.equal(their_stats[k], uploads[0][k]) for k in their_stats)
        sent = [_split(res.uplink["model"])[0] for res in results]   # round 1: theirs exactly (checked above)
        average = {k: sum(w * s[k].double() for w, s in zip(weights, sent)) for k in ours_stats}
        _close({k: v.round() if k.endswith("num_batches_tracked") else v for k, v in average.items()},
               official_state(ours_stats, RESNET_LAYOUT), f"round {r} our global statistics = the clients' "
               "sample-weighted average", RESNET_LAYOUT)
        assert max(float((ours_stats[k] - their_stats[k]).abs().max()) for k in ours_stats) > 1e-3
        with torch.no_grad():   # the next round from bit-identical parameters (their statistics are never sent)
            named = dict(server.global_model.named_parameters())
            for k, v in official_state(ours_params, RESNET_LAYOUT).items():
                named[k.removeprefix("base.")].copy_(v)

        # personalised scoring: their test_metrics (own prompt + global parameters + the client's own statistics)
        server.send_models()
        model = method.model.eval()
        for c, client in enumerate(clients):
            method.evaluator.load(model, c, ours_server, states[c], None)
            ours = _logits(method, model, test)
            own_stats, _ = _split(_to_ours(client.model.state_dict(), shared_keys))
            theirs = _their_logits(official, client)
            twin = copy.copy(client)   # their client with our averaged statistics: then ours exactly
            twin.model = copy.deepcopy(client.model)
            twin.model.load_state_dict(official_state(ours_stats, RESNET_LAYOUT), strict=False)
            _close_tensor(ours, _their_logits(official, twin), f"round {r} client {c} personalised logits, "
                          "their client with our averaged statistics")
            model.load_state_dict(own_stats, strict=False)   # ours with their client's own statistics: theirs
            _close_tensor(_logits(method, model, test), theirs, f"round {r} client {c} personalised logits, ours "
                          "with their client's own statistics")
            assert float((ours - theirs).abs().max()) > 1e-3   # the difference reaches the scores


def _logits(method: PFedPT, model: nn.Module, test: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Our evaluator's logits on the test batches."""
    return torch.cat([method.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {})) for x, y in test])


def _their_logits(official: SimpleNamespace, client: Any) -> Tensor:
    """The logits their ``test_metrics`` scores (recorded by the metrics stand-in)."""
    official.metrics.scored.clear()
    client.test_metrics()
    return torch.from_numpy(official.metrics.scored[0])
