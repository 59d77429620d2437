"""pFedPT: a personal visual prompt (learnable pixels on the image border) + a small ViT trained from scratch, or
the experiment's own backbone trained whole (``arch: experiment``, FedPFT's setting)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from fedcore.backbones.registry import input_cfg, list_archs
from fedcore.constraints import Choice, Int, Number
from fedcore.engine.optim import ClientData, TrainSettings, only_training, run_epochs
from fedcore.engine.roles import Client, Method, Payload
from fedcore.methods import register_method
from fedcore.methods.base import PersonalEvaluator, WholeModelClassifier, raw_backbone

PROMPT = "prompt."  # state-key prefix of the personal prompt (G1)
EXPERIMENT = "experiment"  # ``arch`` value: prompt the experiment's backbone, trained whole


class PadPrompt(nn.Module):
    """pFedPT's prompt: learnable pixels *added* to a ``width``-pixel frame inside the image's border (the centre
    gets nothing), N(0, 1) init as the official PadPrompter. 3·(2·w·S + 2·w·(S−2w)) values: 1344 at S=32, w=4."""

    def __init__(self, size: int, width: int, channels: int = 3) -> None:
        super().__init__()
        if not 0 < 2 * width < size:
            raise ValueError(f"pad_width {width} leaves no image inside a {size}-px frame: allowed 1..{(size - 1) // 2}")
        self.size, self.width = size, width
        self.top = nn.Parameter(torch.randn(1, channels, width, size))
        self.bottom = nn.Parameter(torch.randn(1, channels, width, size))
        self.left = nn.Parameter(torch.randn(1, channels, size - 2 * width, width))
        self.right = nn.Parameter(torch.randn(1, channels, size - 2 * width, width))

    def frame(self) -> Tensor:
        """The prompt as one (1, C, S, S) image, zero inside the frame."""
        inner = self.size - 2 * self.width
        centre = self.left.new_zeros(1, self.left.shape[1], inner, inner)
        middle = torch.cat([self.left, centre, self.right], dim=3)
        return torch.cat([self.top, middle, self.bottom], dim=2)

    def forward(self, x: Tensor) -> Tensor:
        """The prompted images (same size as ``x``)."""
        return x + self.frame().to(x.dtype)


class PromptedScratchViT(nn.Module):
    """Prompt (personal) -> the whole ViT (trainable) -> linear head on its final-norm CLS token."""

    def __init__(self, vit: nn.Module, num_classes: int, pad_width: int) -> None:
        super().__init__()
        self.prompt = PadPrompt(int(vit.patch_embed.img_size[0]), pad_width)
        self.net = vit
        vit.requires_grad_(True)
        self.head = nn.Linear(int(vit.embed_dim), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits."""
        return self.head(self.net(self.prompt(x)))


class PromptedWholeModel(WholeModelClassifier):
    """Prompt (personal) -> the experiment's entire backbone (trainable, BatchNorm in train mode) -> linear head."""

    def __init__(self, net: nn.Module, feature_dim: int, num_classes: int, size: int, pad_width: int) -> None:
        super().__init__(net, feature_dim, num_classes)
        self.prompt = PadPrompt(size, pad_width)

    def features(self, x: Tensor) -> Tensor:
        """The backbone's pooled feature of the prompted images."""
        return super().features(self.prompt(x))


def input_side(adapter: nn.Module) -> int:
    """The side of the images a prompt adapter's backbone takes (ResNet: its input contract; ViT: its patch grid)."""
    side = getattr(adapter, "img_size", None)
    if side is None:
        side = raw_backbone(adapter).patch_embed.img_size[0]
    return int(side)


class PFedPTClient(Client):
    """Stage 1 trains the prompt (ViT frozen), stage 2 the ViT and head (prompt frozen); the ViT + head go up."""

    #: the prompt's optimiser (SGD with momentum) persists across rounds, as the official client builds it once
    keep_optimizer = True

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The ViT and its head (the "base" FedAvg averages)."""
        return [k for k in keys if not k.startswith(PROMPT)]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The prompt never leaves the client."""
        return [k for k in keys if k.startswith(PROMPT)]

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], dict | None]:
        """Stage 1 (prompt, its own kept SGD), then stage 2 (ViT + head, the experiment's optimiser, fresh)."""
        p = self.params
        trainable = self.method.trainable_keys(cid)
        prompt_opt = {"name": "sgd", "lr": float(p["prompt_lr"]), "momentum": float(p["prompt_momentum"]),
                      "weight_decay": 0.0}
        e1 = int(p["prompt_epochs"])
        e2 = settings.local_epochs if p["local_epochs"] is None else int(p["local_epochs"])
        loss = lambda b: self.loss(model, b)  # noqa: E731
        with only_training(model, self.personal_keys(trainable)) as params:
            s1, opt_state = run_epochs(params, data, replace(settings, optimizer=prompt_opt), e1, loss,
                                       state.get("optimizer"))
        with only_training(model, self.shared_keys(trainable)) as params:
            s2, _ = run_epochs(params, data, settings, e2, loss)
        parts = [(s["loss"], e) for s, e in ((s1, e1), (s2, e2)) if e > 0]
        mean = sum(v * e for v, e in parts) / sum(e for _, e in parts) if parts else float("nan")
        return {"loss": mean, "prompt_loss": s1["loss"], "body_loss": s2["loss"]}, opt_state


@register_method
class PFedPT(Method):
    """pFedPT (Li, Huang, Yang, Wang, Jia; "Visual Prompt Based Personalized Federated Learning", TMLR 2024,
    arXiv:2303.08678; code hkgdifyu/pFedPT), as FedHPL's Table 1 baseline ("original setting and ViT models").

    Model: each client's personal prompt G1 (``pad_width`` w = 4 learnable pixels *added* to the border frame of the
    S×S normalised image: 1344 params at S = 32, FedHPL Table 5's 1.3125 K) in front of a small ViT trained from
    random weights with a linear head on its final-norm CLS token. The ViT is the method's own architecture
    (``arch``, default ``vit_pfedpt``: 32 px, 4-px patches, dim 128, 8 blocks, 8 heads, MLP ratio 2; with the head
    1.026 M / 1.037 M params for 10 / 100 classes, Table 5's "ViT"), not the experiment's backbone: the engine
    builds it instead (``Method.own_backbone``) and feeds every client images resized to its input size
    (CIFAR's own 32 px) with mean = std = 0.5, as PFLlib's data. ``vit_pfedpt_mini`` is the 16-px analogue.

    Round (official client): stage 1 trains only the prompt for ``prompt_epochs`` epochs (ViT and head frozen;
    SGD with ``prompt_lr``, ``prompt_momentum``, no weight decay, its state kept across rounds); stage 2 trains
    the ViT and head with the prompt frozen for ``local_epochs`` epochs (None: the experiment's) with the
    experiment's optimiser, fresh each round (the model is replaced by the global one every round). The ViT and
    head go up and are averaged by sample count (FedAvg); the prompt never leaves the client. Evaluation (spec
    §3.3, personalised): client k = its own prompt + the current global ViT and head (the paper: "the aggregated
    model obtains prior knowledge of the data distributions based on the prompts"); a never-trained client
    uses the initial prompt.

    ``arch: experiment`` (FedPFT's pFedPT baseline, spec fedpft §4: every FedPFT method trains the experiment's
    ResNet from scratch): the prompt is sized by the experiment's input (its ``input_size`` if set) and put in
    front of the experiment's backbone as loaded (a ``scratch: true`` backbone: the run's seeded random draw),
    trained whole with its BatchNorm statistics (which go up with it) and a linear head on its pooled feature. In
    stage 1 the frozen backbone stays in train mode (its BatchNorm statistics keep moving, as the official
    client trains the prompt with the model in train mode). Everything else is as above. ``pad_width`` must leave
    an image inside the experiment's input (checked when the method is built, before round 1). The BatchNorm
    statistics are averaged with the model (FedAvg of the state dict: Fling's rule, FedPFT's framework); the
    official server moves ``parameters()`` only (``clientpt.py:97-100``, ``serverbase.py:115-127``), so there each
    client would keep (and be scored with) its own statistics. Its own models (FedAvgCNN, its ViT) have no
    BatchNorm, so this never shows in its runs.

    Choices where the papers are silent, and where ours differ from the official code: defaults are the official
    ones (prompt lr 20, momentum 0.5, 5 prompt epochs; its 5 local epochs are ``local_epochs: 5`` in the
    experiment); the ViT uses timm's initialisation (PlainViT) rather than PyTorch's layer defaults; every
    client starts from the same initial prompt (as the official deep copies); no learning-rate decay (the
    official StepLR has gamma 1); evaluation uses the aggregated ViT, not the official extra "local" print
    (prompt + the client's own stage-2 ViT before averaging); stage 2 uses the experiment's optimiser (the
    official: SGD lr 0.05, no momentum).
    """

    name = "pfedpt"
    defaults = {"arch": "vit_pfedpt", "pad_width": 4, "prompt_epochs": 5, "prompt_lr": 20.0,
                "prompt_momentum": 0.5, "local_epochs": None}
    param_rules = {"arch": Choice((*list_archs("vit"), EXPERIMENT)), "pad_width": Int(1), "prompt_epochs": Int(0),
                   "prompt_lr": Number(0.0, lo_open=True), "prompt_momentum": Number(0.0, 1.0, hi_open=True),
                   "local_epochs": Int(1, optional=True)}
    client_role = PFedPTClient
    evaluator_role = PersonalEvaluator

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """The frame must leave an image inside the arch's input (the experiment's: checked at build)."""
        if params["arch"] == EXPERIMENT:
            return
        size = input_cfg(params["arch"])["img_size"]
        if not 0 < 2 * int(params["pad_width"]) < size:
            raise ValueError(f"key 'pad_width' = {params['pad_width']}: allowed 1..{(size - 1) // 2} (arch "
                             f"{params['arch']} takes {size}-px images)")

    @classmethod
    def own_backbone(cls, params: dict[str, Any]) -> str | None:
        """pFedPT trains its own small ViT from scratch (None: the experiment's backbone, ``arch: experiment``)."""
        return None if params["arch"] == EXPERIMENT else str(params["arch"])

    def build(self, backbone: nn.Module) -> nn.Module:
        """Prompt + the adapter's (randomly initialised) ViT + head, or + the experiment's entire backbone + head."""
        if self.params["arch"] == EXPERIMENT:
            return PromptedWholeModel(raw_backbone(backbone), int(backbone.feature_dim), self.num_classes,
                                      input_side(backbone), int(self.params["pad_width"]))
        vit = raw_backbone(backbone)
        got = getattr(vit, "fedcore_arch", None)
        if got != self.params["arch"]:
            raise ValueError(f"method {self.name} trains arch {self.params['arch']!r} from scratch but was given a "
                             f"{got!r} backbone: build the one Method.own_backbone names (train_run does)")
        return PromptedScratchViT(vit, self.num_classes, int(self.params["pad_width"]))
