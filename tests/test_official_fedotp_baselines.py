"""FedOTP's baselines (PromptFL, PromptFL+FedProx, local CoOp, zero-shot CLIP) against the official FedOTP code
(github.com/HongxiaLee/FedOTP, HEAD 9948611), number for number.

Imported at test time from the checkout named by ``FEDPROMPT_FEDOTP_OFFICIAL`` (the same as
tests/test_official_fedotp.py; nothing of it is copied here): ``trainers/promptfl.py`` (PromptLearner, CustomCLIP,
the PromptFL trainer's ``forward_backward``), ``trainers/clip.py`` (zero-shot CLIP), their vendored Dassl's
``TrainerX.run_epoch`` / ``SimpleTrainer.test`` / ``Classification`` evaluator / ``build_optimizer`` /
``build_lr_scheduler`` / default config, ``federated_main.setup_cfg`` (their config precedence) and
``utils/fed_utils.average_weights``. Stand-ins only for what their harness imports and this comparison never runs:
``yacs`` (a small CfgNode: attributes, clone, YAML and list merges), ``prettytable``, ``torch.utils.tensorboard``,
Dassl's data manager and model zoo. Their federated loop lives inside ``federated_main.main`` (it builds data
loaders from files), so its per-round steps (federated_main.py:239-259 fedavg, 296-310 fedprox, 169-201 CLIP,
445-455 local) are driven here through their own trainer, one line of theirs per step.

Both sides get the same CLIP weights (test_official_fedotp's clip_mini-like CLIP, loaded by their
``clip.build_model``; PromptFL and CLIP build the standard ``VisionTransformer``: CLS after ln_post @ proj), the same
context (ours copied into their ``prompt_learner.ctx``), the same input images and batches (our image tokens
computed in fp32 from the very tensors their image tower reads), fp32 on the CPU (their PREC fp32 path), and the
optimiser of our experiments (config/experiments/fedotp.yaml), which is their GLP_OT/vit_b16.yaml's.
Compared: text features, CLS feature, logit scale, logits, CE loss and the context's gradient; PromptFL's local
updates (2 epochs of 2 batches per client), the server's sample-count average and the evaluation (each client's
accuracy on its own test split with the global prompt, and their unweighted mean) over 2 rounds; CoOp against
their ``local`` branch; zero-shot CLIP's prompts, text features, logits and accuracies. The documented differences
(DEVIATIONS.md, FedOTP; the methods' docstrings) are asserted as what they are: the PromptFL configs' optimiser,
their shared SGD object (momentum leaks from one client into the next), the FedProx term without gradient, their
fp16 precision; and the local configs' epochs, warm-up and one continuous optimiser (found here, now documented).
Run: ``FEDPROMPT_FEDOTP_OFFICIAL=/tmp/fedotp_official python -m pytest -n 0 tests/test_official_fedotp_baselines.py``
(add ``-s`` for the largest differences found).
"""
from __future__ import annotations

import ast
import copy
import importlib
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from fedcore.backbones.registry import prompt_adapter
from fedcore.engine.data import Batch, DeviceSplit, InputPipeline
from fedcore.engine.evaluate import EvalSets, evaluate_round
from fedcore.engine.optim import ClientData, TrainSettings, make_optimizer
from fedcore.engine.roles import FitResult, Method, RoundInfo
from fedcore.methods import method_class
from fedcore.methods.clip_prompt import TOKENS
from fedcore.official_code import checkout_on_path, standin_modules
from test_official_fedotp import ARCH, ENV, N_CTX, NAMES, RTOL, _close, _weights

pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a checkout of the "
                                "official FedOTP code (github.com/HongxiaLee/FedOTP) to compare against")

REPO = Path(__file__).resolve().parents[1]
# our experiments' optimiser (every FedOTP-paper method: spec fedotp §8.10)
OPTIMIZER = yaml.safe_load((REPO / "config/experiments/fedotp.yaml").read_text())["shared"]["optimizer"]
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # CLIP's (their yamls')
PIPELINE = InputPipeline(16, MEAN, STD)
BATCH, EPOCHS = 4, 2
TRAIN_SIZES, TEST_SIZES = (8, 6), (7, 9)
PROX_LR = 0.5
# a local update is up to 4 SGD steps with momentum, each gradient within ~2e-6 of its scale of theirs (fp32 sums in
# other orders: their text tower runs 77 tokens, ours cuts after the last EOT), and the momentum adds them up
UPDATE_RTOL = 5e-5   # unequal: the server's weights and the mean of accuracies are visible
THEIR_PACKAGES = ("Dassl", "clip", "trainers", "utils", "federated_main")


# ---- importing their code -------------------------------------------------------------------------------------
class CfgNode(dict):
    """Stand-in for ``yacs.config.CfgNode`` as their config code uses it: attribute access, ``clone``, ``freeze``,
    ``merge_from_file`` (YAML, string values read as Python literals where they are, as yacs does) and
    ``merge_from_list``."""

    def __getattr__(self, key: str) -> Any:
        """An entry as an attribute."""
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        """An attribute as an entry."""
        self[key] = value

    def clone(self) -> "CfgNode":
        """A deep copy."""
        return copy.deepcopy(self)

    def freeze(self) -> None:
        """Nothing (yacs makes the node read-only)."""

    def merge_from_file(self, path: str) -> None:
        """Merge a YAML file."""
        self._merge(yaml.safe_load(Path(path).read_text()) or {})

    def merge_from_list(self, opts: list[Any]) -> None:
        """Merge ``[key1, value1, key2, value2, ...]``, keys dotted."""
        for key, value in zip(opts[0::2], opts[1::2], strict=True):
            *path, last = key.split(".")
            node = self
            for part in path:
                node = node[part]
            node[last] = _literal(value)

    def _merge(self, other: dict) -> None:
        for key, value in other.items():
            if isinstance(value, dict):
                self.setdefault(key, CfgNode())._merge(value)
            else:
                self[key] = _literal(value)


def _literal(value: Any) -> Any:
    """yacs's decoding of a config value: a string holding a Python literal becomes it (e.g. "(224, 224)")."""
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


STANDINS = {
    "yacs": {}, "yacs.config": {"CfgNode": CfgNode}, "prettytable": {"PrettyTable": None},
    # Dassl's data manager (reads dataset files) and model zoo (SimpleNet): never built here
    "Dassl.dassl.data": {"DataManager": None, "DatasetWrapper": None},
    "Dassl.dassl.modeling": {"build_head": None, "build_backbone": None},
}


@contextmanager
def _tensorboard_standin() -> Iterator[None]:
    """``torch.utils.tensorboard`` (their trainer.py imports SummaryWriter; tensorboard need not be installed, and
    with ``is_fed`` their trainer never opens a writer) while their modules are imported."""
    name = "torch.utils.tensorboard"
    saved = sys.modules.get(name)
    module = ModuleType(name)
    module.SummaryWriter = None
    sys.modules[name] = module
    try:
        yield
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


@dataclass
class Official:
    """Their modules: the two trainers, clip, their Dassl pieces, federated_main and fed_utils."""

    root: Path
    promptfl: ModuleType
    zs: ModuleType
    clip: ModuleType
    trainer: ModuleType
    optim: ModuleType
    evaluation: ModuleType
    main: ModuleType
    fed_utils: ModuleType


@pytest.fixture(scope="module")
def official() -> Official:
    """Their modules, imported from the checkout in $FEDPROMPT_FEDOTP_OFFICIAL."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "trainers" / "promptfl.py").is_file() or not (root / "federated_main.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of HongxiaLee/FedOTP (no trainers/promptfl.py)")
    with _tensorboard_standin(), checkout_on_path(root, THEIR_PACKAGES, standin_modules(STANDINS)):
        # their engine package imports trainers.clip, trainers.promptfl and trainers.GLP_OT in that order (the
        # trainers import it back): first, so that the cycle resolves as in their runs
        importlib.import_module("Dassl.dassl.engine")
        mods = Official(root, *(importlib.import_module(n) for n in (
            "trainers.promptfl", "trainers.clip", "clip.clip", "Dassl.dassl.engine.trainer", "Dassl.dassl.optim",
            "Dassl.dassl.evaluation", "federated_main", "utils.fed_utils")))
    for mod in (mods.promptfl, mods.zs, mods.clip, mods.trainer, mods.optim, mods.main, mods.fed_utils):
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return mods


def _args(config_file: str, **over: Any) -> SimpleNamespace:
    """federated_main's argparse namespace at its defaults (federated_main.py:503-555), ``over`` replacing some."""
    args = dict(model="fedavg", trainer="PromptFL", round=2, num_users=2, frac=1.0, lr=0.001, gamma=1.0,
                train_batch_size=BATCH, test_batch_size=100, seed=1, mu=0.5, iid=False, num_shots=2, useall=False,
                partition="noniid-labeldir100", beta=0.1, imbalance_train=False, split_client=False, num_domain=4,
                n_ctx=N_CTX, num_prompt=2, avg_prompt=1, ctx_init=False, OT="COT", top_percent=1.0, eps=0.1,
                thresh=1e-3, max_iter=100, logdir="unused", root="unused", output_dir="unused", config_file="",
                dataset_config_file="", resume=None, transforms=None, backbone="", head="", eval_only=False,
                model_dir="", load_epoch=None, no_train=False, opts=[])
    args.update(config_file=config_file, **over)
    return SimpleNamespace(**args)


def _cfg(official: Official, config: str, fp32: bool = True, epochs: int | None = None,
         set_lr: float | None = None, **over: Any) -> CfgNode:
    """Their cfg (federated_main.setup_cfg: Dassl defaults, extend_cfg, the trainer yaml, args, then opts) for
    configs/trainers/``config`` at our 16 px images; ``fp32``: their PREC fp32 path (extend_cfg hard-sets fp16);
    ``epochs``, ``set_lr``: OPTIM.MAX_EPOCH and OPTIM.LR set last (as their command-line opts would); ``over``:
    federated_main's arguments (``lr``: --lr)."""
    opts = ["INPUT.SIZE", "(16, 16)"] + (["TRAINER.PROMPTFL.PREC", "fp32"] if fp32 else [])
    opts += ["OPTIM.MAX_EPOCH", str(epochs)] if epochs else []
    opts += ["OPTIM.LR", str(set_lr)] if set_lr else []
    with checkout_on_path(official.root, THEIR_PACKAGES, standin_modules(STANDINS)):   # extend_cfg imports yacs
        return official.main.setup_cfg(_args(str(official.root / "configs" / "trainers" / config), opts=opts,
                                             **over))


# ---- the shared setting ---------------------------------------------------------------------------------------
@dataclass
class Data:
    """Model inputs (float, as their image tower reads them) and labels of each client's train and test split,
    and our fp32 image tokens of the same inputs."""

    train_x: list[Tensor]
    train_y: list[Tensor]
    test_x: list[Tensor]
    test_y: list[Tensor]


def _data(seed: int = 5) -> Data:
    """Random images through the run's input pipeline; client 0 never sees class 4 in training."""
    g = torch.Generator().manual_seed(seed)

    def split(n: int, classes: int) -> tuple[Tensor, Tensor]:
        x = torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8)
        return PIPELINE(x), torch.randint(0, classes, (n,), generator=g)

    train = [split(n, len(NAMES) - (c == 0)) for c, n in enumerate(TRAIN_SIZES)]
    test = [split(n, len(NAMES)) for n in TEST_SIZES]
    return Data([x for x, _ in train], [y for _, y in train], [x for x, _ in test], [y for _, y in test])


def _tokens(method: Method, x: Tensor) -> Tensor:
    """Our image tokens of model inputs ``x`` in fp32 (the artifact stores them float16: a documented choice,
    compared in test_official_fedotp.py)."""
    with torch.no_grad():
        return method.model.clip.encode_image_tokens(x)


def _ours(name: str, weights: dict[str, Tensor], **params: Any) -> Method:
    """Our method ``name`` over a PromptedCLIP holding ``weights``, its context (if any) CoOp's N(0, 0.02^2) draw."""
    import open_clip

    model = open_clip.CLIP(**ARCH, quick_gelu=True)
    model.load_state_dict(weights)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        cls = method_class(name)
        params = {"n_ctx": N_CTX, **params} if "n_ctx" in cls.defaults else params
        return cls(prompt_adapter(model), len(NAMES), params, class_names=NAMES)


def _their_clip(official: Official, weights: dict[str, Tensor], trainer: str, cfg: CfgNode) -> nn.Module:
    """Their ``clip.build_model`` of our weights with the trainer's design (load_clip_to_cpu: fp16), then
    ``.float()`` on their PREC fp32/amp path (the trainers' build_model)."""
    design = {"trainer": trainer, "vision_depth": 0, "language_depth": 0, "vision_ctx": 0, "language_ctx": 0}
    clip_model = official.clip.build_model(dict(weights), design)
    if cfg.TRAINER.PROMPTFL.PREC in ("fp32", "amp"):
        clip_model.float()
    return clip_model


class _Loader(list):
    """A client's loader for their trainer: the batches (dicts with img/label/domain, as Dassl's) in this order;
    ``dataset`` for federated_main's sample counts (len of the loader's dataset)."""

    def __init__(self, batches: list[dict[str, Tensor]], size: int) -> None:
        super().__init__(batches)
        self.dataset = range(size)


def _their_batches(x: Tensor, y: Tensor, size: int) -> list[dict[str, Tensor]]:
    """``x``/``y`` cut into batches of ``size`` in order."""
    return [{"img": x[i:i + size], "label": y[i:i + size], "domain": torch.zeros_like(y[i:i + size])}
            for i in range(0, len(y), size)]


def _their_trainer(official: Official, cfg: CfgNode, weights: dict[str, Tensor], data: Data,
                   ctx: Tensor | None = None, zero_shot: bool = False) -> Any:
    """Their PromptFL (or CLIP) trainer as its ``__init__`` and ``build_model`` make it (trainers/promptfl.py:
    233-266), except the CLIP weights (ours, not a download) and the data manager (our batches, in order)."""
    cls = official.zs.CLIP if zero_shot else official.promptfl.PromptFL
    trainer = cls.__new__(cls)
    official.trainer.TrainerBase.__init__(trainer)
    trainer.cfg, trainer.device, trainer.output_dir = cfg, torch.device("cpu"), "unused"
    trainer.start_epoch = trainer.epoch = 0
    trainer.max_epoch = cfg.OPTIM.MAX_EPOCH
    trainer.fed_train_loader_x_dict = {c: _Loader(_their_batches(x, y, cfg.DATALOADER.TRAIN_X.BATCH_SIZE), len(y))
                                       for c, (x, y) in enumerate(zip(data.train_x, data.train_y))}
    trainer.fed_test_loader_x_dict = {c: _Loader(_their_batches(x, y, cfg.DATALOADER.TEST.BATCH_SIZE), len(y))
                                      for c, (x, y) in enumerate(zip(data.test_x, data.test_y))}
    trainer.evaluator = official.evaluation.build_evaluator(cfg, lab2cname=dict(enumerate(NAMES)))
    trainer.best_result = -np.inf
    trainer.model = (official.zs if zero_shot else official.promptfl).CustomCLIP(
        cfg, NAMES, _their_clip(official, weights, "CLIP" if zero_shot else "PromptFL", cfg))
    for name, p in trainer.model.named_parameters():
        p.requires_grad_("prompt_learner" in name)
    if not zero_shot:
        with torch.no_grad():
            trainer.model.prompt_learner.ctx.copy_(ctx)
        trainer.optim = official.optim.build_optimizer(trainer.model.prompt_learner, cfg.OPTIM)
        trainer.sched = official.optim.build_lr_scheduler(trainer.optim, cfg.OPTIM)
        trainer.register_model("prompt_learner", trainer.model.prompt_learner, trainer.optim, trainer.sched)
    trainer.scaler = None
    return trainer


def _client_data(method: Method, cid: int, data: Data, epochs: int = EPOCHS, batches: int | None = None,
                 lr: float | None = None) -> ClientData:
    """Our ClientData over the client's batches in their order, every epoch (the first ``batches`` only), with the
    experiment's optimiser (at ``lr`` if given)."""
    x, y = data.train_x[cid], data.train_y[cid]
    tokens = _tokens(method, x)
    ours = [Batch(x[i:i + BATCH], y[i:i + BATCH], torch.arange(i, min(i + BATCH, len(y))),
                  {TOKENS: tokens[i:i + BATCH]}) for i in range(0, len(y), BATCH)][:batches]
    optimizer = {**OPTIMIZER, **({"lr": lr} if lr else {})}
    settings = TrainSettings(local_epochs=epochs, batch_size=BATCH, optimizer=optimizer)
    return ClientData(cid, len(y), lambda: iter(ours), torch.Generator().manual_seed(cid), settings=settings)


def _fit(method: Method, cid: int, state: dict, downlink: dict, data: ClientData) -> tuple[dict, FitResult]:
    """Our client's round, its model in train mode as the engine leaves it."""
    method.model_for(cid).train()
    return method.client.fit(cid, state, downlink, data, data.settings)


def _ctx(trainer: Any) -> Tensor:
    """Their prompt context now."""
    return trainer.model.prompt_learner.ctx.detach().clone()


def _close_update(ours: Tensor, theirs: Tensor, start: Tensor, what: str, steps: int) -> float:
    """The update ours - start equals theirs - start to UPDATE_RTOL of its scale plus the rounding of p - lr * buf
    (half an fp32 ulp of |p| per step)."""
    delta = (theirs - start).abs().max()
    ulp = float(start.abs().max()) * 2.0 ** -24 * steps
    diff = float((ours - theirs).abs().max())
    print(f"{what}: max abs diff {diff:.3g}, update scale {float(delta):.3g} ({diff / float(delta):.3g} of it)")
    assert diff <= UPDATE_RTOL * float(delta) + ulp, \
        f"{what}: {diff:.3g} > {UPDATE_RTOL:g} x {float(delta):.3g} + {ulp:.3g}"
    assert float(delta) > 100 * ulp  # the update is far above rounding
    return diff / float(delta)


def _eval_sets(method: Method, data: Data) -> EvalSets:
    """The clients' test splits pooled in one split (what the engine's local evaluation reads), with our tokens."""
    x = torch.cat(data.test_x)
    split = DeviceSplit(torch.zeros(len(x), 16, 16, 3, dtype=torch.uint8), torch.cat(data.test_y),
                        extras={TOKENS: _tokens(method, x)})
    bounds = np.cumsum((0,) + TEST_SIZES)
    return EvalSets(split, [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])], None, "pooled_local")


def _our_accuracies(method: Method, data: Data, server: dict, states: dict | None = None) -> tuple[list, float]:
    """Each client's local accuracy (%) and their mean, by the engine's ``evaluate_round``."""
    def load(c: int | None) -> nn.Module:
        model = method.model_for(0 if c is None else c).eval()
        method.evaluator.load(model, c, server, None if c is None else (states or {}).get(c), None)
        return model

    rows = evaluate_round(method, _eval_sets(method, data), PIPELINE, 100, load)
    local = {c: v for c, split, metric, v in rows if split == "local" and metric == "acc"}
    mean = next(v for c, split, metric, v in rows if (c, split, metric) == (-1, "local", "acc_mean"))
    return [100 * local[c] for c in range(len(TEST_SIZES))], 100 * mean


# ---- configs and optimiser ------------------------------------------------------------------------------------
@contextmanager
def _lr_scheduler_verbose_arg() -> Iterator[None]:
    """Their warm-up schedulers pass ``verbose`` positionally to ``_LRScheduler.__init__`` (Dassl's
    lr_scheduler.py:22), which torch >= 2.7 no longer takes: dropped here, as the torch of their time ignored it
    (it only printed)."""
    base = torch.optim.lr_scheduler.LRScheduler
    init = base.__init__

    def without_verbose(self: Any, optimizer: Any, last_epoch: int = -1, verbose: Any = None) -> None:
        init(self, optimizer, last_epoch)

    base.__init__ = without_verbose
    try:
        yield
    finally:
        base.__init__ = init


def _lrs(official: Official, cfg: CfgNode, epochs: int) -> list[float]:
    """Their learning rate in each of ``epochs`` consecutive client-epochs: one optimiser and scheduler for the
    whole run, stepped once per local epoch (PromptFL.forward_backward's update_lr after its last batch)."""
    optim = official.optim.build_optimizer([nn.Parameter(torch.zeros(1))], cfg.OPTIM)
    with _lr_scheduler_verbose_arg():
        sched = official.optim.build_lr_scheduler(optim, cfg.OPTIM)
    out = []
    for _ in range(epochs):
        out.append(optim.param_groups[0]["lr"])
        optim.step()
        sched.step()
    return out


def test_optimiser_is_their_fedotp_configs_and_not_their_promptfl_configs(official: Official) -> None:
    """Ours (config/experiments/fedotp.yaml: SGD lr 1e-3, momentum 0.9, wd 5e-4, constant) is their effective
    GLP_OT/vit_b16.yaml optimiser; their PromptFL yamls, documented as not used (promptfl.py): vit_b16 (and rn50)
    lr 0.002, cosine over 200 local epochs after one warm-up epoch at 1e-5; vit_b16_ep50 lr 0.005, cosine over 1."""
    ours = make_optimizer([nn.Parameter(torch.zeros(1))], OPTIMIZER).param_groups[0]
    cfg = _cfg(official, "GLP_OT/vit_b16.yaml")
    theirs = official.optim.build_optimizer([nn.Parameter(torch.zeros(1))], cfg.OPTIM)
    assert type(theirs) is torch.optim.SGD
    for key in ("lr", "momentum", "weight_decay", "dampening", "nesterov"):
        assert ours[key] == theirs.param_groups[0][key], key
    assert cfg.OPTIM.MAX_EPOCH == 1 and _lrs(official, cfg, 30) == [1e-3] * 30   # R = 1, constant
    # their PromptFL yamls override extend_cfg's --lr and MAX_EPOCH = 1 (merged after it, federated_main.py:113-119)
    cfg = _cfg(official, "PromptFL/vit_b16.yaml", lr=1e-3)
    assert (cfg.OPTIM.LR, cfg.OPTIM.MAX_EPOCH, cfg.OPTIM.LR_SCHEDULER) == (0.002, 200, "cosine")
    lrs = _lrs(official, cfg, 201)
    cosine = [0.002 * (1 + math.cos(math.pi * e / 200)) / 2 for e in range(200)]
    assert lrs[0] == 1e-5 and lrs[1:] == pytest.approx(cosine, rel=1e-12)
    cfg = _cfg(official, "PromptFL/vit_b16_ep50.yaml", lr=1e-3)
    assert (cfg.OPTIM.LR, cfg.OPTIM.MAX_EPOCH, cfg.OPTIM.ROUND, cfg.OPTIM.LR_SCHEDULER) == (0.005, 1, 50, "cosine")


def test_local_configs_epochs_and_warm_up(official: Official) -> None:
    """CoOp's local configs (DEVIATIONS.md, FedOTP, CoOp (local)): GLP_OT/local.yaml trains 10 epochs at lr 1e-3,
    PromptFL/local.yaml 30 epochs at --lr with one constant warm-up epoch at lr 1e-5; their scheduler is one for the
    whole run, so only the first trained client's first epoch is warmed up. Ours: T x R epochs at the experiment's
    constant lr, no warm-up."""
    cfg = _cfg(official, "GLP_OT/local.yaml", lr=0.003)
    assert (cfg.OPTIM.LR, cfg.OPTIM.MAX_EPOCH, cfg.OPTIM.WARMUP_EPOCH) == (0.001, 10, 0)
    assert _lrs(official, cfg, 20) == [0.001] * 20
    cfg = _cfg(official, "PromptFL/local.yaml", lr=0.001)
    assert (cfg.OPTIM.LR, cfg.OPTIM.MAX_EPOCH, cfg.OPTIM.WARMUP_EPOCH) == (0.001, 30, 1)
    assert _lrs(official, cfg, 60) == [1e-5] + [0.001] * 59   # two clients x 30 epochs


# ---- PromptFL: forward ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights() -> dict[str, Tensor]:
    """The CLIP weights both sides load."""
    return _weights()


@pytest.fixture(scope="module")
def data() -> Data:
    """The clients' inputs."""
    return _data()


def test_promptfl_text_features_logits_loss_and_gradient(official: Official, weights: dict, data: Data) -> None:
    """PromptFL's forward (their trainers/promptfl.py CustomCLIP vs our ContextPrompts): the token ids and frozen
    embeddings around the context, the text features, the CLS feature, the logit scale, the logits (scale x cosine),
    the CE loss and its gradient w.r.t. the context."""
    method = _ours("promptfl", weights)
    ours = method.model
    theirs = _their_trainer(official, _cfg(official, "GLP_OT/vit_b16.yaml"), weights, data, ours.ctx.detach()).model
    assert torch.equal(theirs.tokenized_prompts, ours.token_ids)
    with torch.no_grad():
        emb = ours.clip.token_embedding(ours.token_ids)
        assert torch.equal(theirs.prompt_learner.token_prefix, emb[:, :1])
        assert torch.equal(theirs.prompt_learner.token_suffix, emb[:, 1 + N_CTX:])
        their_text = theirs.text_encoder(theirs.prompt_learner(), theirs.tokenized_prompts)
        _close(ours.clip.encode_text_with_context(ours.contexts(), ours.token_ids, ours.token_eot)[0], their_text,
               "PromptFL text features")
        _close(ours.text_features()[0], F.normalize(their_text, dim=-1), "PromptFL normalised text features")
        x = torch.cat(data.train_x)
        tokens = _tokens(method, x)
        _close(tokens[:, 0], theirs.image_encoder(x), "CLS (image) feature")
    assert ours.logit_scale == float(theirs.logit_scale.exp())
    x, y = data.train_x[0], data.train_y[0]
    mine, their = ours(_tokens(method, x)), theirs(x)
    _close(mine, their, "PromptFL logits")
    loss, their_loss = F.cross_entropy(mine, y), F.cross_entropy(their, y)
    _close(loss, their_loss, "PromptFL CE loss")
    (grad,) = torch.autograd.grad(loss, [ours.ctx])
    (their_grad,) = torch.autograd.grad(their_loss, [theirs.prompt_learner.ctx])
    _close(grad, their_grad, "PromptFL gradient of the context")
    assert float(their_grad.abs().max()) > 0


def test_their_fp16_promptfl_is_within_fp16_rounding(official: Official, weights: dict, data: Data) -> None:
    """Their runs are fp16 (extend_cfg hard-sets PREC; ours fp32, documented: DEVIATIONS.md, FedOTP's CLIP
    backbone): their fp16 logits are ~1e-3 of their scale from ours, the same predictions here."""
    method = _ours("promptfl", weights)
    cfg = _cfg(official, "GLP_OT/vit_b16.yaml", fp32=False)
    assert cfg.TRAINER.PROMPTFL.PREC == "fp16"
    theirs = _their_trainer(official, cfg, weights, data, method.model.ctx.detach()).model
    x = torch.cat(data.test_x)
    with torch.no_grad():
        assert theirs.prompt_learner.ctx.dtype == torch.float16
        their = theirs(x).float()
        ours = method.model(_tokens(method, x))
    rel = float((ours - their).abs().max()) / float(their.abs().max())
    print(f"PromptFL: their fp16 logits vs ours: {rel:.3g} of their scale")
    assert 10 * RTOL < rel < 1e-2
    assert torch.equal(ours.argmax(-1), their.argmax(-1))


# ---- PromptFL: the federated loop -----------------------------------------------------------------------------
def _their_round(official: Official, trainer: Any, global_weights: dict, clients: list[int], epoch: int,
                 fresh: bool = True, fedprox: bool = False) -> tuple[dict, dict[int, Tensor]]:
    """Their fedavg round (federated_main.py:245-252; fedprox: 301-308): each client loads the global weights,
    trains, and its state dict is kept; then average_weights by training-set size. ``fresh``: their SGD's momentum
    cleared before each client (ours: a fresh optimiser per client per round), else theirs as it is."""
    local_weights: list[Any] = [[] for _ in range(len(TRAIN_SIZES))]
    numbers = [len(trainer.fed_train_loader_x_dict[c].dataset) for c in range(len(TRAIN_SIZES))]
    ctx = {}
    for idx in clients:
        if fresh:
            trainer.optim.state.clear()
        trainer.model.load_state_dict(global_weights, strict=False)
        if fedprox:
            trainer.train(idx=idx, global_epoch=epoch, is_fed=True, global_weight=global_weights, fedprox=True, mu=0.5)
        else:
            trainer.train(idx=idx, global_epoch=epoch, is_fed=True)
        local_weights[idx] = copy.deepcopy(trainer.model.state_dict())
        ctx[idx] = _ctx(trainer)
    return official.fed_utils.average_weights(local_weights, clients, numbers), ctx


def _their_accuracies(trainer: Any, weights: dict, clients: list[int]) -> list[float]:
    """Their evaluation of each client (federated_main.py:255-259): the weights loaded, ``test(idx)``'s accuracy."""
    out = []
    for idx in clients:
        trainer.model.load_state_dict(weights, strict=False)
        out.append(trainer.test(idx=idx)[0])
    return out


def test_promptfl_two_rounds_updates_server_average_and_evaluation(official: Official, weights: dict,
                                                                   data: Data) -> None:
    """Two rounds of PromptFL, both clients sampled: each local update (2 epochs x 2 batches, SGD with momentum
    and weight decay), the server's average weighted by training-set size, and every client's accuracy on its own
    test split with the global prompt and their unweighted mean (their fedavg branch; "Global test acc")."""
    method = _ours("promptfl", weights)
    trainer = _their_trainer(official, _cfg(official, "GLP_OT/vit_b16.yaml", epochs=EPOCHS), weights, data,
                             method.model.ctx.detach())
    global_weights = copy.deepcopy(trainer.model.state_dict())   # federated_main.py:178
    server = method.strategy.init_state(2)
    clients = [0, 1]
    for r in (1, 2):
        start = server["model"]["ctx"].clone()
        if r == 1:
            assert torch.equal(start, global_weights["prompt_learner.ctx"])
        their_global, their_ctx = _their_round(official, trainer, global_weights, clients, r - 1)
        results = []
        for c in clients:
            _, res = _fit(method, c, method.client.init_state(c), method.strategy.configure(server, c),
                          _client_data(method, c, data))
            results.append(res)
            assert list(res.uplink["model"]) == ["ctx"] and res.num_samples == TRAIN_SIZES[c]
            _close_update(res.uplink["model"]["ctx"], their_ctx[c], start, f"PromptFL round {r} client {c} update",
                          EPOCHS * 2)
        server = method.strategy.aggregate(RoundInfo(r, 2, 1.0, 0), server, results)
        # their average_weights averages the whole state dict: the frozen CLIP and token buffers are the same on
        # every client and stay so (up to the rounding of sum_i w_i x); only the context moves
        average = their_global["prompt_learner.ctx"]
        _close_update(server["model"]["ctx"], average, start, f"PromptFL round {r} server average", EPOCHS * 2)
        weights_ = torch.tensor(TRAIN_SIZES, dtype=torch.float64) / sum(TRAIN_SIZES)
        by_hand = sum(w * their_ctx[c].double() for w, c in zip(weights_, clients))
        assert torch.allclose(average.double(), by_hand, rtol=0, atol=1e-7)
        for key, value in their_global.items():
            if key != "prompt_learner.ctx":
                assert torch.allclose(value, global_weights[key], rtol=1e-6, atol=1e-7), key
        # the next stages from bit-identical inputs: their global prompt := ours, once compared (each stage's own
        # rounding is then what is measured, not the carried one)
        global_weights = {**their_global, "prompt_learner.ctx": server["model"]["ctx"].clone()}
        theirs = _their_accuracies(trainer, global_weights, list(range(2)))
        accs, mean = _our_accuracies(method, data, server)
        print(f"PromptFL round {r}: accuracies ours {accs} (mean {mean:.2f}), theirs {theirs}")
        assert accs == pytest.approx(theirs, abs=1e-9)
        assert mean == pytest.approx(sum(theirs) / len(theirs), abs=1e-9)
    assert len(set(accs)) > 1 and 0 < mean < 100


def test_promptfl_their_shared_optimiser_leaks_momentum_into_the_next_client(official: Official, weights: dict,
                                                                             data: Data) -> None:
    """Documented (DEVIATIONS.md, FedOTP, Training): their one SGD object serves every client, so client 1's first
    step carries 0.9 x client 0's last momentum buffer: their step = ours (a fresh optimiser) - lr x 0.9 x buf."""
    method = _ours("promptfl", weights)
    cfg = _cfg(official, "GLP_OT/vit_b16.yaml")
    trainer = _their_trainer(official, cfg, weights, data, method.model.ctx.detach())
    global_weights = copy.deepcopy(trainer.model.state_dict())
    _their_round(official, trainer, global_weights, [0], 0, fresh=False)
    buf = trainer.optim.state[trainer.model.prompt_learner.ctx]["momentum_buffer"].clone()
    trainer.fed_train_loader_x_dict[1] = _Loader(trainer.fed_train_loader_x_dict[1][:1], TRAIN_SIZES[1])
    _, their_ctx = _their_round(official, trainer, global_weights, [1], 0, fresh=False)   # one step, with the leak
    server = method.strategy.init_state(2)
    _, res = _fit(method, 1, method.client.init_state(1), method.strategy.configure(server, 1),
                  _client_data(method, 1, data, 1, 1))
    start = server["model"]["ctx"]
    leak = -OPTIMIZER["lr"] * OPTIMIZER["momentum"] * buf
    _close_update(res.uplink["model"]["ctx"] + leak, their_ctx[1], start, "client 1's step, ours - lr 0.9 buf", 1)
    assert float(leak.abs().max()) > 0.5 * float((their_ctx[1] - start).abs().max())   # not negligible


def test_promptfl_fedprox_their_term_has_no_gradient(official: Official, weights: dict, data: Data) -> None:
    """Documented (DEVIATIONS.md, FedOTP, PromptFL + FedProx; spec §8.3): their proximal term is built from
    ``state_dict()`` tensors (promptfl.py:290-293), so their FedProx update is PromptFL's, bit for bit, and equals
    ours at mu = 0; ours at mu = 0.5 differs by exactly -lr mu (P_1 - P_g) after two steps (P_1: after the first,
    the same on both). At lr PROX_LR on both sides: at 1e-3 the term's effect would be below fp32 rounding."""
    method = _ours("promptfl_fedprox", weights, mu=0.0)
    cfg = _cfg(official, "GLP_OT/vit_b16.yaml", set_lr=PROX_LR, model="fedprox")
    ctx = method.model.ctx.detach()
    prox, plain = (_their_trainer(official, cfg, weights, data, ctx) for _ in range(2))
    for t in (prox, plain):
        t.fed_train_loader_x_dict[0] = _Loader(t.fed_train_loader_x_dict[0][:2], TRAIN_SIZES[0])
    global_weights = copy.deepcopy(prox.model.state_dict())
    _, with_term = _their_round(official, prox, global_weights, [0], 0, fedprox=True)
    _, without = _their_round(official, plain, global_weights, [0], 0)
    assert torch.equal(with_term[0], without[0])
    server = method.strategy.init_state(2)
    start = server["model"]["ctx"]

    def fit(steps: int) -> Tensor:
        """Our client 0 after ``steps`` steps from the global prompt."""
        _, res = _fit(method, 0, method.client.init_state(0), method.strategy.configure(server, 0),
                      _client_data(method, 0, data, 1, steps, lr=PROX_LR))
        return res.uplink["model"]["ctx"]

    at_zero = fit(2)
    _close_update(at_zero, with_term[0], start, "PromptFL+FedProx: theirs vs ours at mu 0", 2)
    method.params["mu"] = 0.5
    first, two = fit(1), fit(2)
    expected = -PROX_LR * 0.5 * (first - start)
    _close(two - at_zero, expected, "PromptFL+FedProx: ours at mu 0.5 - theirs = -lr mu (P_1 - P_g)", rtol=1e-4)


# ---- CoOp: their local branch ---------------------------------------------------------------------------------
def test_coop_is_their_local_branch_with_a_fresh_optimiser_each_round(official: Official, weights: dict,
                                                                      data: Data) -> None:
    """Their ``local`` model (federated_main.py:445-455): each client trains MAX_EPOCH epochs from the shared
    initial context and is scored on its own test split. Ours (coop) in one round of as many epochs: the same
    contexts and accuracies (their momentum cleared between clients, as above). Over T rounds of R epochs ours
    restarts the optimiser every round (documented, CoOp (local)): T = 2 rounds of 1 epoch equal their first epoch,
    then differ from their 2 continuous epochs by the momentum carried across the epoch boundary."""
    method = _ours("coop", weights)
    cfg = _cfg(official, "GLP_OT/vit_b16.yaml", epochs=EPOCHS, model="local")
    trainer = _their_trainer(official, cfg, weights, data, method.model.ctx.detach())
    global_weights = copy.deepcopy(trainer.model.state_dict())
    server = method.strategy.init_state(2)
    assert server["model"] == {}   # nothing is shared
    theirs, their_ctx, states = [], {}, {}
    for idx in (0, 1):
        trainer.optim.state.clear()
        trainer.model.load_state_dict(global_weights)
        trainer.train(idx=idx, global_epoch=0, is_fed=True)
        theirs.append(trainer.test(idx=idx)[0])
        their_ctx[idx] = _ctx(trainer)
        states[idx], res = _fit(method, idx, method.client.init_state(idx), method.strategy.configure(server, idx),
                                _client_data(method, idx, data))
        assert res.uplink["model"] == {}
        _close_update(states[idx]["model"]["ctx"], their_ctx[idx], global_weights["prompt_learner.ctx"],
                      f"CoOp client {idx} ({EPOCHS} epochs)", EPOCHS * 2)
    accs, mean = _our_accuracies(method, data, server, states)
    print(f"CoOp: accuracies ours {accs}, theirs {theirs}")
    assert accs == pytest.approx(theirs, abs=1e-9) and mean == pytest.approx(sum(theirs) / 2, abs=1e-9)
    # T = 2 rounds of R = 1 epoch: a fresh optimiser at the second epoch
    state = method.client.init_state(0)
    for _ in range(2):
        state, _ = _fit(method, 0, state, method.strategy.configure(server, 0), _client_data(method, 0, data, 1))
    gap = float((state["model"]["ctx"] - their_ctx[0]).abs().max()) / float(
        (their_ctx[0] - global_weights["prompt_learner.ctx"]).abs().max())
    print(f"CoOp: 2 rounds x 1 epoch vs their 2 continuous epochs: {gap:.3g} of the update")
    assert gap > 1e-2


# ---- zero-shot CLIP -------------------------------------------------------------------------------------------
class _NoCuda(TorchFunctionMode):
    """Their zero-shot forward moves the prompts to CUDA (trainers/clip.py:221-222): on this CPU-only check,
    ``Tensor.cuda`` returns the tensor itself."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``func``, but ``Tensor.cuda`` is the identity."""
        if func is Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def test_zero_shot_clip_prompts_text_features_logits_and_accuracies(official: Official, weights: dict,
                                                                    data: Data) -> None:
    """Zero-shot CLIP (trainers/clip.py with --ctx_init, as their help says): "a photo of a {name}." ("_" a space),
    the same token ids, text features, logits and each client's accuracy (their CLIP branch,
    federated_main.py:193-214, at frac 1: every client, once; at frac < 1 they score a random subset, documented)."""
    method = _ours("zs_clip", weights)
    cfg = _cfg(official, "GLP_OT/vit_b16.yaml", trainer="CLIP", model="CLIP", ctx_init="True")
    trainer = _their_trainer(official, cfg, weights, data, zero_shot=True)
    theirs = trainer.model
    ours = method.model
    prompts = [f"a photo of a {n.replace('_', ' ')}." for n in NAMES]
    assert torch.equal(theirs.tokenized_prompts, ours.clip._tokenize(prompts))
    with torch.no_grad():
        their_text = theirs.text_encoder(theirs.prompt_learner(), theirs.tokenized_prompts)
        _close(ours.clip.encode_text(prompts), their_text, "zero-shot text features")
        _close(ours.text, F.normalize(their_text, dim=-1), "zero-shot normalised text features")
        x = torch.cat(data.test_x)
        with _NoCuda():
            their_logits = theirs(x)
        _close(ours(_tokens(method, x)), their_logits, "zero-shot logits")
    global_weights = copy.deepcopy(theirs.state_dict())   # federated_main.py:170
    np.random.seed(0)
    m = max(int(1.0 * 2), 1)
    idxs = np.random.choice(range(2), m, replace=False)   # federated_main.py:197-198 at frac 1
    with _NoCuda():
        their_accs = dict(zip(idxs.tolist(), _their_accuracies(trainer, global_weights, idxs.tolist())))
    accs, mean = _our_accuracies(method, data, method.strategy.init_state(2))
    print(f"zero-shot CLIP: accuracies ours {accs}, theirs {their_accs}")
    assert accs == pytest.approx([their_accs[c] for c in range(2)], abs=1e-9)
    assert mean == pytest.approx(sum(their_accs.values()) / 2, abs=1e-9)
