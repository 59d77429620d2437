"""FedVPT's and FedVPT-D's prompted ViT against the official VPT code (github.com/KMnP/vpt), number for number.

Opt-in: ``FEDPROMPT_VPT_OFFICIAL`` names a checkout of KMnP/vpt (``git archive`` of 4410440). Its prompted ViT
(``src/models/vit_prompt/vit.py``: ``PromptedTransformer``, ``PromptedVisionTransformer``), the ViT wrapper with its
head (``src/models/vit_models.py``: ``ViT``, ``src/models/mlp.py``), the config defaults (``src/configs/config.py``),
the optimiser, loss and step (``src/solver/optimizer.py``, ``losses.py``, ``src/engine/trainer.py``) and the
top-1 metric (``src/engine/eval/singlelabel.py``) are imported from there at test time; nothing of it is copied
here. CI has no checkout and no internet: every test skips there.

    FEDPROMPT_VPT_OFFICIAL=/tmp/vpt_official python -m pytest -n 0 tests/test_official_vpt.py

Stand-ins replace only what their harness imports and the checks never run: ``ml_collections`` (an attribute dict),
``fvcore``'s config node and checkpointer, ``iopath``, ``simplejson``, ``termcolor``, and their
``src/models/build_vit_backbone.py`` (the model zoo: pretrained weight files and the Swin / MoCo / MAE builders on
an old timm), whose ``build_vit_sup_models`` becomes "their ``PromptedVisionTransformer`` at the given config"
(what it does before loading weights). Their ViT config gets vit_mini's shape (D = 64, 4 blocks, 4 heads, 4-px
patches, 16 px), registered in their ``CONFIGS`` under ``FEATURE``, with dropout 0.1 (ViT-B/16's) so that a
backbone left in train mode would show.

Both sides hold the same tensors: our FedVPT / FedVPT-D model (registry vit_mini, random weights scaled so that
attention and LayerNorm do real work) is copied into their ``ViT`` under their names (backbone:
``fedcore.official_sgpt.official_backbone_state``; ``prompts.0`` -> ``prompt_embeddings`` (1, n, D), ``prompts.i``
-> ``deep_prompt_embeddings[i - 1]``, ``head`` -> ``head.last_layer``); fp32 on the CPU, prompt lengths 1 (ours)
and 5 (theirs). Compared: the init bound and the prompt tensors each side builds; the embeddings with the prompts
(``incorporate_prompt``); every block's input and output (which tokens a deep prompt replaces); the final-norm
tokens, the CLS feature and the logits in train and eval mode; the loss and its gradients w.r.t. every prompt and
the head; SGD steps (their ``make_optimizer`` and ``Trainer.forward_one_batch`` against our client's ``fit`` and
the one pass that trains a round's clients together); the evaluation loss and top-1 accuracy.

Documented differences (DEVIATIONS.md, "FedVPT / FedVPT-D"; fedcore/methods/base.py ``VPTMethod``) are asserted as
what they say: our prompt length 1 (their default NUM_TOKENS 5, ``config.py:50``); their head is ``MLP`` with
``special_bias`` (``vit_models.py:160-165``, ``mlp.py:53-57``: kaiming-normal weight, bias -log(99)), ours
PyTorch's default Linear init (SGPT's); their SGD exempts ``head.last_layer.bias`` from weight decay
(``optimizer.py:60-62``), ours decays every trained tensor (SGPT's optimiser): one step differs by exactly
lr * wd * b on the head bias, and with that one group aligned every tensor agrees after several steps.
"""
from __future__ import annotations

import copy
import importlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.prompted import PromptedViT, attention_backend, init_prompts
from fedcore.backbones.vit import build_vit
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.methods.base import VPTMethod
from fedcore.methods.fedvpt import FedVPT
from fedcore.methods.fedvpt_d import FedVPTDeep
from fedcore.official_code import checkout_on_path, standin_modules

ENV = "FEDPROMPT_VPT_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a local checkout of "
                                "github.com/KMnP/vpt (none in CI, which has no internet)")

RTOL, ATOL = 1e-5, 1e-6                  # fp32 on the CPU: their softmax attention and our SDPA round differently
DIM, DEPTH, HEADS, PATCH, SIDE = 64, 4, 4, 4, 16   # vit_mini
CLASSES, BATCH = 10, 12
TOKENS = (1, 5)                          # ours (SGPT spec 7.15) and their default NUM_TOKENS
MODES = ("shallow", "deep")
#: SGD with momentum; lr 0.1 moves the tensors, wd 0.01 (VPT's CUB config) makes the head-bias exemption visible
OPT = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
FEATURE = "fedprompt_vit_mini"           # our mini config's key in their CONFIGS
VERBOSE = bool(os.environ.get("FEDPROMPT_VERBOSE"))   # every comparison's differences (with -s)
WORST: dict[str, float] = {}             # max abs difference per compared quantity (printed with VERBOSE)


# ---- importing the official code ---------------------------------------------------------------------------------
def _standins() -> dict[str, ModuleType]:
    """Third-party modules their harness imports (configs, logging, checkpoints, file I/O) and their model zoo."""
    from fedcore.official_sgpt import AttrDict

    class CfgNode(AttrDict):
        """fvcore's CfgNode as config.py uses it: nested attribute dicts, ``clone``."""

        def clone(self) -> "CfgNode":
            """A deep copy."""
            return copy.deepcopy(self)

    class PathManager:
        """iopath's PathManager as file_io.py builds it (never opens a file here)."""

        def register_handler(self, handler: Any) -> None:
            """Nothing to register."""

    mods = standin_modules({
        "ml_collections": {"ConfigDict": lambda d=None: AttrDict(d or {})},
        "simplejson": {"dumps": json.dumps},
        "termcolor": {"colored": lambda text, *a, **k: text},
        "iopath": {}, "iopath.common": {},
        "iopath.common.file_io": {"PathManager": PathManager, "HTTPURLHandler": object},
        "fvcore": {}, "fvcore.common": {}, "fvcore.common.config": {"CfgNode": CfgNode},
        "fvcore.common.checkpoint": {"Checkpointer": object},
        # filled in once their prompted ViT is imported (_import_official)
        "src.models.build_vit_backbone": {"build_swin_model": None, "build_mocov3_model": None,
                                          "build_mae_model": None},
    })
    try:   # vit_backbones/vit.py imports turtle.forward (unused); turtle needs tkinter, absent on some machines
        importlib.import_module("turtle")
    except ImportError:
        mods.update(standin_modules({"turtle": {"forward": None}}))
    return mods


def _import_official(root: Path) -> SimpleNamespace:
    """Their modules, imported with the checkout first on sys.path (``src`` unregistered afterwards)."""
    mods = _standins()
    with checkout_on_path(root, ("src",), mods):
        vp = importlib.import_module("src.models.vit_prompt.vit")

        def build_vit_sup_models(model_type: str, crop_size: int, prompt_cfg: Any = None, model_root: str = "",
                                 adapter_cfg: Any = None, load_pretrain: bool = True, vis: bool = False):
            """build_vit_backbone.py's builder for a prompted ViT, without the weight file (ours are copied in)."""
            assert prompt_cfg is not None and adapter_cfg is None
            model = vp.PromptedVisionTransformer(prompt_cfg, model_type, crop_size, num_classes=-1, vis=vis)
            return model, vp.CONFIGS[model_type].hidden_size

        mods["src.models.build_vit_backbone"].build_vit_sup_models = build_vit_sup_models
        out = SimpleNamespace(vit_prompt=vp, **{name: importlib.import_module(f"src.{path}") for name, path in (
            ("vit_models", "models.vit_models"), ("config", "configs.config"), ("optimizer", "solver.optimizer"),
            ("losses", "solver.losses"), ("trainer", "engine.trainer"), ("singlelabel", "engine.eval.singlelabel"))})
    for mod in (out.vit_prompt, out.vit_models, out.optimizer, out.trainer):
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return out


@pytest.fixture(scope="module")
def official() -> SimpleNamespace:
    """Their modules, with vit_mini's shape registered as ``CONFIGS[FEATURE]``."""
    from fedcore.official_sgpt import mini_config
    root = Path(os.environ[ENV]).resolve()
    if not (root / "src" / "models" / "vit_prompt" / "vit.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of KMnP/vpt (no src/models/vit_prompt/vit.py)")
    off = _import_official(root)
    config = mini_config(DIM, DEPTH, HEADS, PATCH)
    config.transformer.dropout_rate = config.transformer.attention_dropout_rate = 0.1
    off.vit_prompt.CONFIGS[FEATURE] = config
    return off


def _their_cfg(official: SimpleNamespace, mode: str, n: int, opt: dict = OPT) -> Any:
    """Their default config (get_cfg) set as a VPT run of ours: prompt transfer, shallow or deep, n tokens, our
    classes, crop size and optimiser."""
    cfg = official.config.get_cfg()
    cfg.MODEL.TRANSFER_TYPE = "prompt"
    cfg.MODEL.PROMPT.NUM_TOKENS = n
    cfg.MODEL.PROMPT.DEEP = mode == "deep"
    cfg.DATA.FEATURE, cfg.DATA.CROPSIZE, cfg.DATA.NUMBER_CLASSES = FEATURE, SIDE, CLASSES
    cfg.SOLVER.OPTIMIZER, cfg.SOLVER.BASE_LR = opt["name"], opt["lr"]
    cfg.SOLVER.MOMENTUM, cfg.SOLVER.WEIGHT_DECAY = opt["momentum"], opt["weight_decay"]
    return cfg


# ---- the shared model and data -----------------------------------------------------------------------------------
def _randomise(model: nn.Module, seed: int) -> None:
    """Non-trivial backbone weights (both sides get them): a mapping slip or an ignored tensor then shows. Prompts
    keep VPT's init, the head PyTorch's default."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.backbone.vit.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif p.ndim >= 2 and name not in ("pos_embed", "cls_token"):
                p.copy_(1.5 * r / p[0].numel() ** 0.5)          # fan-in scaled: logits of order one
            else:
                p.copy_(0.5 * r)


def _their_names(mode: str) -> dict[str, tuple[str, int | None]]:
    """Our trainable tensor -> (their tensor, row of it or None): prompts.0 is their prompt_embeddings[0] (the
    input prompt), prompts.i (i >= 1) their deep_prompt_embeddings[i - 1]; the head is their MLP's last layer."""
    names: dict[str, tuple[str, int | None]] = {"prompts.0": ("enc.transformer.prompt_embeddings", 0)}
    if mode == "deep":
        names.update({f"prompts.{i}": ("enc.transformer.deep_prompt_embeddings", i - 1) for i in range(1, DEPTH)})
    names.update({"head.weight": ("head.last_layer.weight", None), "head.bias": ("head.last_layer.bias", None)})
    return names


def _their_state(model: nn.Module, mode: str) -> dict[str, Tensor]:
    """Our FedVPT(-D) model's tensors under their ViT's names and shapes (a full state dict)."""
    from fedcore.official_sgpt import official_backbone_state
    out = official_backbone_state(model.backbone.vit, "enc.transformer.")
    prompts = [p.detach().clone() for p in model.prompts]
    out["enc.transformer.prompt_embeddings"] = prompts[0][None]
    if mode == "deep":
        out["enc.transformer.deep_prompt_embeddings"] = torch.stack(prompts[1:])
    out["head.last_layer.weight"] = model.head.weight.detach().clone()
    out["head.last_layer.bias"] = model.head.bias.detach().clone()
    return out


def _read(state: dict[str, Tensor], name: str, row: int | None) -> Tensor:
    """Their tensor (or its row) in our layout."""
    return state[name] if row is None else state[name][row]


@dataclass
class Pair:
    """Our FedVPT / FedVPT-D and their ViT holding the same tensors, and a batch."""

    mode: str
    n: int
    method: VPTMethod
    theirs: nn.Module
    cfg: Any
    x: Tensor
    y: Tensor

    @property
    def ours(self) -> nn.Module:
        """Our PromptClassifier."""
        return self.method.models[0]


def _pair(official: SimpleNamespace, mode: str, n: int, seed: int = 0, batch: int = BATCH) -> Pair:
    """Both models (ours seeded, randomised and copied into theirs) and ``batch`` images with labels."""
    torch.manual_seed(seed)
    cls = FedVPTDeep if mode == "deep" else FedVPT
    method = cls(PromptedViT(build_vit("vit_mini")), CLASSES, {"num_prompts": n})
    _randomise(method.models[0], seed + 1)
    cfg = _their_cfg(official, mode, n)
    theirs = official.vit_models.ViT(cfg, load_pretrain=False)
    theirs.load_state_dict(_their_state(method.models[0], mode), strict=True)   # every tensor of theirs named once
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(batch, 3, SIDE, SIDE, generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    return Pair(mode, n, method, theirs, cfg, x, y)


PAIRS = [(m, n) for m in MODES for n in TOKENS]
IDS = [f"{m}-{n}tok" for m, n in PAIRS]


@pytest.fixture(scope="module", params=PAIRS, ids=IDS)
def pair(request, official) -> Pair:
    """Both models at one (mode, prompt length); tests that train build their own."""
    return _pair(official, *request.param)


def _close(a: Tensor, b: Tensor, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """assert_close with the max abs / rel difference in the message (and in WORST)."""
    diff = (a.double() - b.double()).abs()
    worst = (float(diff.max()), float((diff / b.double().abs().clamp_min(1e-3)).max()))
    key = what.split(":")[0]
    WORST[key] = max(WORST.get(key, 0.0), worst[0])
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol,
                               msg=f"{what}: max abs {worst[0]:.3g}, max rel {worst[1]:.3g}")
    if VERBOSE:
        print(f"{what}: max abs {worst[0]:.2e}, max rel {worst[1]:.2e}")


class _Blocks:
    """Forward hooks keeping every block's input and output (their blocks return (tokens, attention weights))."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.inputs: list[Tensor] = []
        self.outputs: list[Tensor] = []
        self.handles = [b.register_forward_hook(self) for b in blocks]

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.inputs.append(args[0].detach())
        self.outputs.append((output[0] if isinstance(output, tuple) else output).detach())

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self.handles:
            h.remove()


# ---- the configuration and the init ------------------------------------------------------------------------------
def test_their_defaults_and_the_documented_prompt_length(official):
    """Their defaults (config.py) against our FedVPT: prompts prepended after CLS, random init, no projection,
    prompt dropout 0 (ours has none), the CLS token pooled, a one-layer head; prompt length 5 there, 1 here
    (documented: SGPT spec 7.15)."""
    p = official.config.get_cfg().MODEL.PROMPT
    assert (p.LOCATION, p.INITIATION, p.PROJECT, p.DROPOUT, p.VIT_POOL_TYPE) == ("prepend", "random", -1, 0.0,
                                                                               "original")
    assert p.NUM_DEEP_LAYERS is None and not p.DEEP_SHARED and not p.DEEP
    assert official.config.get_cfg().MODEL.MLP_NUM == 0
    assert p.NUM_TOKENS == 5
    assert FedVPT.defaults["num_prompts"] == FedVPTDeep.defaults["num_prompts"] == 1 == VPTMethod.defaults[
        "num_prompts"]
    model = _pair(official, "deep", 1).ours
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())   # no prompt dropout to configure


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", TOKENS)
def test_prompt_init_and_layout_equal_the_official(official, mode: str, n: int):
    """Their bound val = sqrt(6 / (3 p^2 + D)) (vit.py:57) is ours, to the bit; one uniform(-val, val) draw fills
    their input prompt, another the (L - 1) deep ones (vit.py:62, 70): with the same generator state our
    init_prompts gives the same numbers; both sides hold one (n, D) prompt per block (deep) or one (shallow)."""
    calls: list[tuple[Tensor, float, float]] = []
    real = nn.init.uniform_

    def record(t: Tensor, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
        calls.append((t, a, b))   # every uniform_ of the build (torch's Linear init too); held: no address reuse
        return real(t, a, b, generator=generator)

    with mock.patch.object(nn.init, "uniform_", record):
        theirs = official.vit_models.ViT(_their_cfg(official, mode, n), load_pretrain=False)
    t = theirs.enc.transformer
    held = [t.prompt_embeddings] + ([t.deep_prompt_embeddings] if mode == "deep" else [])
    bounds = [(a, b) for x, a, b in calls if x.data_ptr() in {p.data_ptr() for p in held}]
    v = math.sqrt(6.0 / (3 * PATCH * PATCH + DIM))
    assert bounds == [(-v, v)] * len(held)
    torch.manual_seed(11)
    ours = init_prompts(n, DIM, PATCH)
    torch.manual_seed(11)
    ref = real(torch.zeros(1, n, DIM), -bounds[0][1], bounds[0][1])
    assert torch.equal(ours.detach(), ref[0])
    assert 0.8 * v < float(init_prompts(4096, DIM, PATCH).detach().abs().max()) <= v
    assert tuple(t.prompt_embeddings.shape) == (1, n, DIM)
    model = _pair(official, mode, n).ours
    assert [tuple(p.shape) for p in model.prompts] == [(n, DIM)] * (DEPTH if mode == "deep" else 1)
    if mode == "deep":
        assert tuple(t.deep_prompt_embeddings.shape) == (DEPTH - 1, n, DIM)
    else:
        assert not hasattr(t, "deep_prompt_embeddings")
    for p in model.prompts:
        assert float(p.detach().abs().max()) <= v


def test_head_init_differs_as_documented(official):
    """Documented difference: their head (MLP, special_bias; mlp.py:53-57) draws kaiming-normal (fan_out) weights
    and sets every bias to -log(99); ours is PyTorch's default Linear (uniform within 1/sqrt(D)), as SGPT's code."""
    torch.manual_seed(0)
    theirs = official.vit_models.ViT(_their_cfg(official, "shallow", 1), load_pretrain=False)
    head = theirs.head
    assert isinstance(head.projection, nn.Sequential) and len(head.projection) == 0   # MLP_NUM 0: one layer
    w, b = head.last_layer.weight.detach(), head.last_layer.bias.detach()
    assert torch.equal(b, torch.full((CLASSES,), -math.log(0.99 / 0.01)))
    assert 0.7 * math.sqrt(2 / CLASSES) < float(w.std()) < 1.3 * math.sqrt(2 / CLASSES)
    ours = _pair(official, "shallow", 1).ours.head
    ours_w, ours_b = ours.weight.detach(), ours.bias.detach()
    bound = 1 / math.sqrt(DIM)
    assert float(ours_w.abs().max()) <= bound and float(ours_b.abs().max()) <= bound
    assert float(ours_b.std()) > 0                                           # not a constant prior
    assert float(w.abs().max()) > 2 * bound                                  # a real difference


# ---- the forward pass --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [True, False], ids=["train_mode", "eval_mode"])
def test_tokens_cls_and_logits_equal_the_official(pair: Pair, train: bool):
    """The embeddings with the input prompts (incorporate_prompt), every block's input and output, the final-norm
    tokens, the CLS feature and the logits, in train mode (their train() keeps the backbone in eval: dropout 0.1
    stays off) and in eval mode."""
    model, t = pair.ours, pair.theirs
    model.train(train)
    t.train(train)
    ours_hooks, their_hooks = _Blocks(model.backbone.vit.blocks), _Blocks(t.enc.transformer.encoder.layer)
    try:
        with torch.no_grad(), attention_backend("cpu"):
            prompts = {i: p for i, p in enumerate(model.prompts)}
            mode = "replace" if pair.mode == "deep" else "insert"
            ours_tokens = model.backbone.forward_tokens(pair.x, prompts, mode=mode)
            ours_cls, ours_logits = model.features(pair.x), model(pair.x)
            their_tokens = t.enc.transformer(pair.x)[0]
            their_cls, their_logits = t.enc(pair.x), t(pair.x)
            embedded = t.enc.transformer.incorporate_prompt(pair.x)
    finally:
        ours_hooks.remove()
        their_hooks.remove()
    tokens = 1 + pair.n + (SIDE // PATCH) ** 2
    assert embedded.shape == (BATCH, tokens, DIM)
    _close(ours_hooks.inputs[0], embedded, "embeddings with prompts (block 0 input)")
    for i in range(DEPTH):
        _close(ours_hooks.inputs[i], their_hooks.inputs[i], f"block {i} input")
        _close(ours_hooks.outputs[i], their_hooks.outputs[i], f"block {i} output")
    assert ours_tokens.shape == their_tokens.shape == (BATCH, tokens, DIM)
    _close(ours_tokens, their_tokens, "final-norm tokens")
    _close(ours_cls, their_cls, "CLS feature")
    _close(ours_logits, their_logits, "logits")


def test_which_tokens_a_prompt_takes(pair: Pair):
    """On both sides: the input prompts sit right after CLS at block 0; deep: at block i >= 1 tokens 1..n are
    exactly prompt i (their deep_prompt_embeddings[i - 1], vit.py:114-121) and every other token is the previous
    block's output; shallow: every block after the first reads the previous block's output whole."""
    model, t, n = pair.ours, pair.theirs, pair.n
    model.train()
    t.train()
    hooks = {"ours": _Blocks(model.backbone.vit.blocks), "theirs": _Blocks(t.enc.transformer.encoder.layer)}
    try:
        with torch.no_grad(), attention_backend("cpu"):
            model(pair.x)
            t(pair.x)
    finally:
        for h in hooks.values():
            h.remove()
    emb = t.enc.transformer.embeddings(pair.x)
    deep = t.enc.transformer.deep_prompt_embeddings if pair.mode == "deep" else None
    for side, h in hooks.items():
        x0 = h.inputs[0]
        assert torch.equal(x0[:, :1], emb[:, :1]) and torch.equal(x0[:, 1 + n:], emb[:, 1:]), side
        assert torch.equal(x0[:, 1:1 + n], model.prompts[0].detach().expand(BATCH, -1, -1)), side
        for i in range(1, DEPTH):
            xi, prev = h.inputs[i], h.outputs[i - 1]
            if deep is None:
                assert torch.equal(xi, prev), f"{side}: block {i} input"
                continue
            assert torch.equal(xi[:, 1:1 + n], model.prompts[i].detach().expand(BATCH, -1, -1)), f"{side}: {i}"
            assert torch.equal(xi[:, 1:1 + n], deep[i - 1].detach().expand(BATCH, -1, -1)), f"{side}: {i}"
            assert torch.equal(xi[:, :1], prev[:, :1]) and torch.equal(xi[:, 1 + n:], prev[:, 1 + n:]), side
            assert not torch.equal(xi[:, 1:1 + n], prev[:, 1:1 + n])   # the previous prompt outputs are gone


# ---- gradients, SGD steps, evaluation ----------------------------------------------------------------------------
def test_loss_and_gradients_equal_the_official(pair: Pair, official):
    """Their SoftmaxLoss (sum of CE / B, unit class weights) = our mean CE; d loss / d every prompt and the head;
    their trainable tensors (TRANSFER_TYPE prompt: the names holding 'prompt', and the head) are ours."""
    model, t = pair.ours, pair.theirs
    model.train()
    t.train()
    model.zero_grad(set_to_none=True)
    t.zero_grad(set_to_none=True)
    criterion = official.losses.build_loss(pair.cfg)
    with attention_backend("cpu"):
        loss = F.cross_entropy(model(pair.x), pair.y)
        their_loss = criterion(t(pair.x), pair.y, [1.0] * CLASSES)
        loss.backward()
        their_loss.backward()
    _close(loss.detach(), their_loss.detach(), "loss")
    names = _their_names(pair.mode)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(names) == set(pair.method.trainable_keys(0))
    assert {n for n, p in t.named_parameters() if p.requires_grad} == {v[0] for v in names.values()}
    grads = {n: p.grad for n, p in t.named_parameters() if p.requires_grad}
    ours = dict(model.named_parameters())
    for n, (theirs, row) in names.items():
        assert float(ours[n].grad.abs().max()) > 1e-6, f"{n}: no gradient"
        _close(ours[n].grad, _read(grads, theirs, row), f"grad {n}")
    model.zero_grad(set_to_none=True)
    t.zero_grad(set_to_none=True)


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid))


def _their_trainer(official: SimpleNamespace, cfg: Any, model: nn.Module, align_bias_decay: bool) -> Any:
    """Their Trainer as its __init__ and train_classifier set it up for a step: make_optimizer, build_loss, unit
    class weights (CLASS_WEIGHTS_TYPE none); the scheduler (warm-up + cosine over epochs) and checkpointer are not
    used (our runs keep the learning rate constant). ``align_bias_decay``: the head bias decays as ours does."""
    trainer = official.trainer.Trainer.__new__(official.trainer.Trainer)
    trainer.cfg, trainer.model, trainer.device = cfg, model, torch.device("cpu")
    trainer.optimizer = official.optimizer.make_optimizer([model], cfg.SOLVER)
    trainer.cls_criterion = official.losses.build_loss(cfg)
    trainer.cls_weights = [1.0] * CLASSES
    decays = [g["weight_decay"] for g in trainer.optimizer.param_groups]
    bias = model.head.last_layer.bias
    for g in trainer.optimizer.param_groups:   # the exemption (optimizer.py:60-62): only the head bias has none
        assert g["weight_decay"] == (0.0 if g["params"][0] is bias else OPT["weight_decay"]), decays
        if align_bias_decay:
            g["weight_decay"] = OPT["weight_decay"]
    return trainer


def _their_fit(official: SimpleNamespace, pair: Pair, start: dict[str, Tensor], batches: list[tuple[Tensor, Tensor]],
               epochs: int, align_bias_decay: bool) -> dict[str, Tensor]:
    """Their training steps from ``start`` (our names) over ``batches``: model.train(), then forward_one_batch per
    batch, as train_classifier does; their trained tensors after it."""
    t = pair.theirs
    state = t.state_dict()
    for n, (theirs, row) in _their_names(pair.mode).items():
        if row is None:
            state[theirs] = start[n].clone()
        else:
            state[theirs][row] = start[n]
    t.load_state_dict(state)
    trainer = _their_trainer(official, pair.cfg, t, align_bias_decay)
    t.train()
    for _ in range(epochs):
        for x, y in batches:
            loss, _ = official.trainer.Trainer.forward_one_batch(trainer, x, y, True)
            assert torch.is_tensor(loss) and torch.isfinite(loss)
    return {k: v.detach().clone() for k, v in t.state_dict().items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", TOKENS)
def test_one_sgd_step_equals_the_official(official, mode: str, n: int):
    """One step from a fresh optimiser (momentum buffer = gradient): every prompt and the head weight equal theirs;
    the head bias differs by exactly lr * wd * b (their exemption from weight decay, documented)."""
    pair = _pair(official, mode, n, seed=3)
    m = pair.method
    start = {k: v.detach().clone() for k, v in pair.ours.state_dict().items()}
    downlink = {"model": {k: start[k] for k in m.client.shared_keys(m.keys(0))}}
    batches = [(pair.x, pair.y)]
    settings = TrainSettings(local_epochs=1, batch_size=BATCH, optimizer=OPT)
    with attention_backend("cpu"):
        _, result = m.client.fit(0, m.client.init_state(0), downlink, _data(0, batches), settings)
        theirs = _their_fit(official, pair, start, batches, 1, align_bias_decay=False)
    uploaded = result.uplink["model"]
    assert set(uploaded) == set(_their_names(mode))
    for name, (their_name, row) in _their_names(mode).items():
        assert float((uploaded[name] - start[name]).abs().max()) > 1e-5, f"{name} did not move"
        ref = _read(theirs, their_name, row)
        if name == "head.bias":
            _close(uploaded[name] - ref, -OPT["lr"] * OPT["weight_decay"] * start[name], "head bias: ours - theirs")
            assert float((uploaded[name] - ref).abs().max()) > 1e-4          # the exemption is visible here
        else:
            _close(uploaded[name], ref, f"one step: {name}")


@pytest.mark.parametrize("mode", MODES)
def test_local_update_equals_the_official_with_the_bias_decay_aligned(official, mode: str):
    """Two clients, 2 epochs of 2 batches each (momentum in play), their head bias decayed as ours: our one-by-one
    fit and our one pass over both clients (the path a run takes on the CPU) equal their trainer's steps."""
    n = 1
    pair = _pair(official, mode, n, seed=5, batch=4 * 6)
    m = pair.method
    start = {k: v.detach().clone() for k, v in pair.ours.state_dict().items()}
    downlink = {"model": {k: start[k] for k in m.client.shared_keys(m.keys(0))}}
    clients = [[(pair.x[i:i + 6], pair.y[i:i + 6]) for i in (s, s + 6)] for s in (0, 12)]
    epochs = 2
    settings = TrainSettings(local_epochs=epochs, batch_size=6, optimizer=OPT)
    model = pair.ours
    with attention_backend("cpu"):
        one_by_one = [m.client.fit(c, m.client.init_state(c), downlink, _data(c, b), settings)[1]
                      for c, b in enumerate(clients)]
        plan = m.client.together("cpu", model.train())
        assert plan.fit is not None and plan.exact
        together = [r for _, r in plan.fit([m.client.init_state(c) for c in range(2)], [downlink] * 2,
                                           [_data(c, b) for c, b in enumerate(clients)], settings)]
        theirs = [_their_fit(official, pair, start, b, epochs, align_bias_decay=True) for b in clients]
    for c in range(2):
        for name, (their_name, row) in _their_names(mode).items():
            ref = _read(theirs[c], their_name, row)
            assert float((one_by_one[c].uplink["model"][name] - start[name]).abs().max()) > 1e-4, name
            _close(one_by_one[c].uplink["model"][name], ref, f"local update: {name} (client {c})", atol=2e-6)
            _close(together[c].uplink["model"][name], ref, f"one pass: {name} (client {c})", atol=2e-6)


def test_evaluation_equals_the_official(pair: Pair, official):
    """Evaluation: their forward_one_batch(is_train=False) after model.eval() (logits and loss) and their top-1
    (singlelabel.compute_acc_auc) against our evaluator's logits and argmax accuracy."""
    m, t = pair.method, pair.theirs
    model = pair.ours.eval()
    t.eval()
    trainer = _their_trainer(official, pair.cfg, t, align_bias_decay=False)
    x = torch.cat([pair.x, 2 * pair.x])       # more samples: accuracy away from 0 and 1 under random labels
    y = torch.cat([pair.y, pair.y.flip(0)])
    with attention_backend("cpu"):
        ours = m.evaluator.predict(model, Batch(x, y, torch.arange(len(y)), {}))
        their_loss, theirs = official.trainer.Trainer.forward_one_batch(trainer, x, y, False)
    _close(ours, theirs, "evaluation logits")
    _close(F.cross_entropy(ours, y), their_loss, "evaluation loss")
    top1 = official.singlelabel.compute_acc_auc(theirs.numpy(), list(y.numpy()))["top1"]
    assert torch.equal(ours.argmax(1), theirs.argmax(1))
    assert float((ours.argmax(1) == y).double().mean()) == pytest.approx(top1)
    model.train()


def test_report_worst_differences():
    """Print the largest difference seen per compared quantity (FEDPROMPT_VERBOSE=1, with -s); runs last."""
    if VERBOSE:
        for k, v in sorted(WORST.items()):
            print(f"max abs diff {k}: {v:.2e}")
