"""FedPR's null-space projection and aggregation against the official code (github.com/chunmeifeng/FedPR, HEAD).

Opt-in: ``FEDPROMPT_FEDPR_OFFICIAL`` names a checkout of chunmeifeng/FedPR (``git archive HEAD``). Its
``util/adam_svd.py`` (``AdamSVD``), ``engine.py`` (``train_one_epoch_null_nohead``) and ``train.py``
(``average_model``) are imported from there at test time; nothing of it is copied here. CI has no checkout and no
internet: every test skips there.

    FEDPROMPT_FEDPR_OFFICIAL=/tmp/fedpr_official python -m pytest -n 0 tests/test_official_fedpr.py

Their model (a Swin MRI reconstructor with a pre-trained decoder) is not used: FedPR's method lies in the optimiser
and the server, so both sides train the SAME model, our VPT-deep ``vit_mini`` classifier. Their side sees it under
their names (``enc.prompter.prompt_<i>``, (1, n, D) tensors: ``TheirView``), trained by their epoch loop and their
``AdamSVD`` (prompts in its ``svd`` group; our linear head, which FedPR does not have, in a group without
projection), aggregated by their ``average_model``, with the projector built by their ``get_eigens`` /
``get_transforms`` from ``bmm(pᵀ, p)`` of the global prompts (train.py's two lines, written here). Ours: FedPR's
client and strategy roles with the experiment optimiser set to Adam (the official optimiser; runs use SGD).

Compared: (1) a round-1 local update (unconstrained on both sides), (2) the server average of the prompts, (3) the
projector of every block against ours (I − UUᵀ), (4) a round-2 local update under the projection. Documented
differences (fedcore/methods/fedpr.py docstring; DEVIATIONS.md, FedPR) are asserted as what they are: their
projector is ours divided by its Frobenius norm sqrt(D − k); their rule protects int(D·(1 − ratio)) directions even
beyond the prompts' rank (ours caps at the rank); their per-client Adam state persists across rounds. To compare
the rest, round 2 gives their clients a fresh AdamSVD (round-1 projectors) with the prompt learning rate
multiplied by that norm, and every stage starts from bit-identical tensors (our global model copied into theirs).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import math
import os
from collections import defaultdict
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
from fedcore.engine.optim import ClientData, OptimizerSpec, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo
from fedcore.methods.fedpr import FedPR
from fedcore.official_code import checkout_on_path

ENV = "FEDPROMPT_FEDPR_OFFICIAL"
pytestmark = pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set: it names a local checkout of "
                                "github.com/chunmeifeng/FedPR (none in CI, which has no internet)")

RTOL, ATOL = 1e-5, 1e-6                 # fp32 on the CPU
DIM, DEPTH, CLASSES, BATCH = 64, 4, 4, 8   # vit_mini's width and depth
TOKENS = 4                              # prompt tokens per block: the global prompts' rank is 4
KEEP = 1.0 - TOKENS / DIM               # their ratio rule then protects int(64 · 4/64) = 4 = the rank: same k
LR, WD = 0.01, 1e-4
#: torch's Adam with AdamSVD's betas (0.9, 0.999) and eps 0. Why eps 0: torch adds eps to sqrt(v̂),
#: AdamSVD to sqrt(v) (adam_svd.py:163-169), i.e. in torch's terms their eps is eps / sqrt(1 − β₂ᵗ) (≈ 32·eps at step
#: 1). At eps 1e-8 that moved these 6-step prompt updates by up to 4.6e-5 (entries with small gradients): an Adam
#: detail, not FedPR's (runs use SGD), kept out of the comparison. No gradient entry is exactly 0 here (no 0/0).
ADAM = OptimizerSpec("adam", LR, weight_decay=WD, eps=0.0)
SIZES = (24, 16)                        # two clients' sample counts: unequal FedAvg weights
EPOCHS = 2
VERBOSE = bool(os.environ.get("FEDPROMPT_VERBOSE"))   # every comparison's differences (with -s)
#: their top-level module names and our stand-ins for what only their MRI harness imports
THEIR_PACKAGES = ("util", "engine", "train", "models", "data", "config", "tensorboardX", "imageio", "skimage",
                  "matplotlib")


# ---- importing the official code ---------------------------------------------------------------------------------
def _standins() -> dict[str, ModuleType]:
    """Modules only their MRI harness needs (data sets, config, Swin model, logging, image metrics and files)."""
    mods = {n: ModuleType(n) for n in ("tensorboardX", "data", "config", "models.vit_models", "imageio", "skimage",
                                       "skimage.metrics", "matplotlib", "matplotlib.pyplot")}
    mods["tensorboardX"].SummaryWriter = object
    mods["data"].build_different_dataloader = mods["data"].build_server_dataloader = None
    mods["config"].build_config = None
    mods["models.vit_models"].Swin = None
    mods["skimage.metrics"].peak_signal_noise_ratio = mods["skimage.metrics"].structural_similarity = None
    mods["skimage"].metrics, mods["matplotlib"].pyplot = mods["skimage.metrics"], mods["matplotlib.pyplot"]
    return mods


def _official_on_path(root: Path) -> contextlib.AbstractContextManager[None]:
    """Their checkout first on sys.path with the stand-ins (their generic top-level names must not leak
    into other tests)."""
    return checkout_on_path(root, THEIR_PACKAGES, _standins())


@pytest.fixture(scope="module")
def official() -> SimpleNamespace:
    """Their ``AdamSVD``, ``train_one_epoch_null_nohead`` and ``average_model``."""
    root = Path(os.environ[ENV]).resolve()
    if not (root / "util" / "adam_svd.py").is_file():
        pytest.fail(f"{ENV}={root} is not a checkout of chunmeifeng/FedPR (no util/adam_svd.py)")
    with _official_on_path(root):
        mods = {n: importlib.import_module(n) for n in ("util.adam_svd", "engine", "train")}
    for mod in mods.values():
        assert Path(mod.__file__).resolve().is_relative_to(root), f"imported {mod.__file__}, not from {root}"
    return SimpleNamespace(AdamSVD=mods["util.adam_svd"].AdamSVD,
                           train_epoch=mods["engine"].train_one_epoch_null_nohead,
                           average_model=mods["train"].average_model)


# ---- the shared model and data -----------------------------------------------------------------------------------
class TheirView(nn.Module):
    """Our prompted classifier under the official names: the block prompts as ``enc.prompter.prompt_<i>`` of shape
    (1, n, D) (their PromptedSwinTransformer's layout), the frozen backbone and our head as ``inner``."""

    def __init__(self, ours: nn.Module) -> None:
        super().__init__()
        self.inner = copy.deepcopy(ours)
        self.enc = nn.Module()
        self.enc.prompter = nn.ParameterDict({f"prompt_{i}": nn.Parameter(p.detach().clone()[None])
                                              for i, p in enumerate(ours.prompts)})
        for p in self.inner.prompts:   # the inner copies are never read: the prompter's tensors replace them
            p.requires_grad_(False)

    def forward(self, image: Tensor) -> Tensor:
        """Logits of their (B, 1, 3, S, S) input (their loop unsqueezes a channel)."""
        prompts = {i: p[0] for i, p in enumerate(self.enc.prompter.values())}
        tokens = self.inner.backbone.forward_tokens(image.squeeze(1), prompts, mode="replace")
        return self.inner.head(tokens[:, 0])

    def prompts(self) -> list[Tensor]:
        """The block prompts as ours, (n, D)."""
        return [p.detach()[0] for p in self.enc.prompter.values()]

    def adopt(self, state: dict[str, Tensor]) -> None:
        """Our global tensors (``prompts.<i>``, ``head.*``) copied in: the next stage starts bit-identical."""
        with torch.no_grad():
            for i, p in enumerate(self.enc.prompter.values()):
                p.copy_(state[f"prompts.{i}"][None])
            for k, p in self.inner.head.named_parameters():
                p.copy_(state[f"head.{k}"])


class _Criterion(nn.Module):
    """Their loop's ``criterion(outputs, target)['loss']``: cross-entropy on the label they unsqueezed."""

    def forward(self, outputs: Tensor, target: Tensor) -> dict[str, Tensor]:
        """{'loss': CE}."""
        return {"loss": F.cross_entropy(outputs, target[:, 0])}


def _method(num_prompts: int = TOKENS, keep: float = KEEP) -> FedPR:
    """Our FedPR on vit_mini (a seeded random draw), CLASSES-way head."""
    torch.manual_seed(0)
    return FedPR(PromptedViT(build_vit("vit_mini")), CLASSES, {"num_prompts": num_prompts, "keep_ratio": keep})


def _batches(n: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """A client's fixed batches of BATCH images and labels."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return [(x[s:s + BATCH], y[s:s + BATCH]) for s in range(0, n, BATCH)]


def _data(cid: int, batches: list[tuple[Tensor, Tensor]]) -> ClientData:
    """Our ClientData over exactly these batches, in this order, every epoch."""
    ours = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    return ClientData(cid, sum(len(y) for _, y in batches), lambda: iter(ours), torch.Generator().manual_seed(cid))


def _loader(batches: list[tuple[Tensor, Tensor]]) -> list[tuple]:
    """Their loop's batches: (image, target, mean, std, fname, slice_num); only the first two are read."""
    return [(x, y, None, None, None, None) for x, y in batches]


def _their_optimizer(official: SimpleNamespace, view: TheirView, prompt_lr: float = LR) -> Any:
    """Their AdamSVD as train.py builds it (prompts, lr, weight decay, ratio), plus our head in a group without
    projection (their head is a frozen decoder; ours is trained and not projected: DEVIATIONS.md, FedPR)."""
    return official.AdamSVD([{"params": list(view.enc.prompter.values()), "lr": prompt_lr},
                             {"params": list(view.inner.head.parameters()), "svd": False}],
                            lr=LR, weight_decay=WD, eps=0.0, ratio=KEEP)


def _their_projectors(official: SimpleNamespace, server: TheirView, optimizer: Any) -> None:
    """train.py after ``average_model``: fea_in[idx] = bmm(pᵀ, p) of each global prompt, then the client optimiser's
    ``get_eigens`` and ``get_transforms``."""
    fea_in = defaultdict(dict)
    for idx, (_, p) in enumerate(server.enc.prompter.named_parameters()):
        fea_in[idx] = torch.bmm(p.transpose(1, 2), p)
    optimizer.get_eigens(fea_in=fea_in)
    optimizer.get_transforms()


def _close(a: Tensor, b: Tensor, what: str, rtol: float = RTOL, atol: float = ATOL) -> tuple[float, float]:
    """assert_close with the max abs / rel difference in the message; returns them."""
    diff = (a.double() - b.double()).abs()
    worst = (float(diff.max()), float((diff / b.double().abs().clamp_min(1e-3)).max()))
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol,
                               msg=f"{what}: max abs {worst[0]:.3g}, max rel {worst[1]:.3g}")
    if VERBOSE:
        print(f"{what}: max abs {worst[0]:.2e}, max rel {worst[1]:.2e}")
    return worst


def _compare_upload(upload: dict[str, Tensor], view: TheirView, what: str) -> None:
    """Every uploaded tensor (prompts, head) against their client's."""
    worst = [0.0, 0.0]
    for i, p in enumerate(view.prompts()):
        worst = [max(w, d) for w, d in zip(worst, _close(upload[f"prompts.{i}"], p, f"{what} prompts.{i}"))]
    for k, p in view.inner.head.named_parameters():
        worst = [max(w, d) for w, d in zip(worst, _close(upload[f"head.{k}"], p.detach(), f"{what} head.{k}"))]
    print(f"{what}: max abs {worst[0]:.2e}, max rel {worst[1]:.2e}")


# ---- the tests ---------------------------------------------------------------------------------------------------
def test_two_rounds_of_local_updates_aggregation_and_projector_equal_the_official(official):
    """Round 1 (no projector), the server (prompt average, per-block projector), round 2 (projected updates): our
    FedPR client and strategy against their loop, AdamSVD and average_model."""
    method = _method()
    data = {c: _batches(n, 10 + c) for c, n in enumerate(SIZES)}
    views = {c: TheirView(method.model) for c in data}
    server_view = TheirView(method.model)
    settings = TrainSettings(local_epochs=EPOCHS, batch_size=BATCH, optimizer=ADAM)
    info = RoundInfo(round=0, num_clients=len(SIZES), participation=1.0, seed=0)
    server = method.strategy.init_state(len(SIZES))
    optimizers = {c: _their_optimizer(official, views[c]) for c in data}

    def round_(r: int, server: dict) -> list[FitResult]:
        results = []
        with attention_backend("cpu"):
            for c in data:
                method.model_for(c).train()
                _, res = method.client.fit(c, method.client.init_state(c), method.strategy.configure(server, c),
                                           _data(c, data[c]), settings)
                results.append(res)
                for _ in range(EPOCHS):
                    official.train_epoch(views[c], _Criterion(), _loader(data[c]), optimizers[c], "cpu")
                _compare_upload(res.uplink["model"], views[c], f"round {r} client {c}")
        return results

    # round 1: no projector on either side (AdamSVD: ``len(self.transforms) == 0``; ours: no basis yet)
    assert server["fedpr_basis"] == {}
    results = round_(1, server)
    server = method.strategy.aggregate(info, server, results)
    weights = [n / sum(SIZES) for n in SIZES]
    official.average_model(server_view, list(views.values()), list(data), weights)
    for i, p in enumerate(server_view.prompts()):
        _close(server["model"][f"prompts.{i}"], p, f"global prompts.{i}")
    server_view.adopt(server["model"])   # bit-identical global prompts for the projectors and round 2
    for c in data:
        views[c].adopt(server["model"])  # their average_model copies only the prompts; the head's FedAvg is ours
        _their_projectors(official, server_view, optimizers[c])

    # the projector of each block: theirs (I − UUᵀ) / ‖I − UUᵀ‖_F, norm sqrt(D − k), k = the prompts' rank here
    eye = torch.eye(DIM, dtype=torch.float64)
    norm = math.sqrt(DIM - TOKENS)
    for i, (p, q) in enumerate(zip(views[0].enc.prompter.values(), views[1].enc.prompter.values())):
        basis = server["fedpr_basis"][f"prompts.{i}"].double()
        assert basis.shape == (DIM, TOKENS)
        theirs = optimizers[0].transforms[p][0]   # keyed by the client's own tensor
        _close(theirs * norm, eye - basis @ basis.T, f"block {i} projector x sqrt(D - k)")
        _close(torch.linalg.matrix_norm(theirs).reshape(1), torch.tensor([1.0]), f"block {i} ‖T‖_F")
        assert torch.equal(optimizers[1].transforms[q][0], theirs)   # every sampled client gets the same one

    # the documented difference, one step from the round-2 start: their prompt step is ours / sqrt(D − k)
    one = {c: copy.deepcopy(views[c]) for c in data}
    step_opt = _their_optimizer(official, one[0])
    step_opt.transforms = {q: optimizers[0].transforms[p] for q, p in zip(one[0].enc.prompter.values(),
                                                                            views[0].enc.prompter.values())}
    with attention_backend("cpu"):
        official.train_epoch(one[0], _Criterion(), _loader(data[0][:1]), step_opt, "cpu")
        method.model_for(0).train()
        _, res = method.client.fit(0, method.client.init_state(0), method.strategy.configure(server, 0),
                                   _data(0, data[0][:1]), TrainSettings(1, BATCH, ADAM))
    for i, p in enumerate(one[0].prompts()):
        start = server["model"][f"prompts.{i}"]
        ours_step = res.uplink["model"][f"prompts.{i}"] - start
        _close((p - start) * norm, ours_step, f"one step, block {i}: theirs x sqrt(D - k)")
        assert float(ours_step.abs().max()) > 1e-3                          # a real step, not rounding

    # round 2: their clients with a fresh AdamSVD (ours restarts its optimiser each round; theirs keeps its state:
    # documented) holding the round-1 projectors, its prompt lr multiplied by sqrt(D − k) to undo the normalisation
    # the documented difference is real: their kept Adam state (at the same scaled lr) gives another round 2
    kept_view, kept_opt = copy.deepcopy((views[0], optimizers[0]))   # one deepcopy: the optimiser keeps its tensors
    kept_opt.param_groups[0]["lr"] = LR * norm
    kept_opt.transforms = {q: optimizers[0].transforms[p]   # torch's Optimizer.__getstate__ drops the attribute
                           for q, p in zip(kept_view.enc.prompter.values(), views[0].enc.prompter.values())}
    with attention_backend("cpu"):
        for _ in range(EPOCHS):
            official.train_epoch(kept_view, _Criterion(), _loader(data[0]), kept_opt, "cpu")
    for c in data:
        fresh = _their_optimizer(official, views[c], prompt_lr=LR * norm)
        fresh.transforms = optimizers[c].transforms
        optimizers[c] = fresh
    results = round_(2, server)
    apart = max(float((results[0].uplink["model"][f"prompts.{i}"] - p).abs().max())
                for i, p in enumerate(kept_view.prompts()))
    if VERBOSE:
        print(f"round 2 client 0 with their kept Adam state: prompts apart by {apart:.2e}")
    assert apart > 1e-4
    for c, res in enumerate(results):
        for i in range(DEPTH):
            basis = server["fedpr_basis"][f"prompts.{i}"]
            moved = res.uplink["model"][f"prompts.{i}"] - server["model"][f"prompts.{i}"]
            assert float(moved.abs().max()) > 1e-3
            assert float((moved @ basis).abs().max()) < 1e-5              # nothing along the protected directions
    server = method.strategy.aggregate(info, server, results)
    official.average_model(server_view, list(views.values()), list(data), weights)
    for i, p in enumerate(server_view.prompts()):
        _close(server["model"][f"prompts.{i}"], p, f"round 2 global prompts.{i}")


def test_their_ratio_rule_also_protects_directions_beyond_the_rank(official):
    """The configured FedPR (1 token per block, ratio 0.8): their projector keeps int(64 · 0.8) = 52 directions
    (protects 12: the prompt's own and 11 arbitrary ones of the zero eigenspace), ours keeps 63 (protects the rank,
    1): documented (fedpr.py ``protected_basis``). Both annihilate the global prompt itself."""
    method = _method(num_prompts=1, keep=0.8)
    server = method.strategy.init_state(1)
    upload = {k: v.detach().clone() for k, v in method.model.state_dict().items() if k in method.trainable_keys(0)}
    server = method.strategy.aggregate(RoundInfo(0, 1, 1.0, 0), server, [FitResult(0, 8, {"model": upload}, {})])
    view = TheirView(method.model)
    opt = official.AdamSVD(list(view.enc.prompter.values()), lr=LR, ratio=0.8)
    for p in view.enc.prompter.values():     # get_eigens / get_transforms skip tensors without a gradient
        p.grad = torch.zeros_like(p)
    _their_projectors(official, view, opt)
    for i, p in enumerate(view.enc.prompter.values()):
        kept = opt.transforms[p][0].double() * math.sqrt(52)    # their T·‖T‖_F
        _close(kept @ kept, kept, f"block {i}: T·‖T‖ is a projector")
        assert round(float(kept.diagonal().sum())) == 52           # of rank 52: 12 directions protected
        assert server["fedpr_basis"][f"prompts.{i}"].shape == (DIM, 1)   # ours: 1 protected, 63 kept
        assert float((p.detach()[0].double() @ kept).abs().max()) < 1e-5  # both protect the prompt itself
