"""What several prompt methods share: the prompted classifier they train and a recipe that builds it.

The roles (client update, server strategy, evaluator) and the ``Method`` recipe live in the engine
(``fedcore.engine.roles``); a method file subclasses only the pieces where it differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.prompted import PromptedViT, init_prompts
from fedcore.backbones.registry import build_backbone
from fedcore.constraints import Choice, Constraint, Int, Number, RunFacts, Violation
from fedcore.engine.aggregation import add_counts
from fedcore.engine.data import Batch
from fedcore.engine.onepass import Owners
from fedcore.engine.optim import ClientData, autocast_for
from fedcore.engine.batching import OnePass, OnePassEval, epochs_of_loss
from fedcore.engine.roles import Client, Evaluator, Method, Payload, RoundInfo, Strategy, Together

__all__ = ["PromptClassifier", "PromptMethod", "BatchableClient", "ce_losses", "prompt_one_pass", "EveryClient", "PersonalEvaluator",
           "WholeModelClassifier", "WholeModelMethod", "raw_backbone", "whole_model", "PrototypeMethod",
           "PrototypeClient", "PrototypeEvaluator", "prototype_loss", "prototype_uplink", "nearest_prototype_logits",
           "CommonDim", "per_class_sums", "TEACHER", "TEACHER_MASK", "with_teacher", "distillation_loss", "kd_loss", "DistillClient"]


class PromptClassifier(nn.Module):
    """Frozen prompted ViT + optional shallow/deep prompts + a linear head on the CLS token."""

    def __init__(self, backbone: PromptedViT, num_classes: int, prompt_mode: str = "none",
                 num_prompts: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        dim, depth, patch = backbone.embed_dim, backbone.depth, backbone.patch_size
        self.prompt_mode = prompt_mode
        if prompt_mode == "none":
            self.prompts = nn.ParameterList()
        elif prompt_mode == "shallow":
            self.prompts = nn.ParameterList([init_prompts(num_prompts, dim, patch)])
        elif prompt_mode == "deep":
            self.prompts = nn.ParameterList([init_prompts(num_prompts, dim, patch) for _ in range(depth)])
        else:
            raise ValueError(f"prompt_mode must be none|shallow|deep, got {prompt_mode!r}")
        self.head = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor, owners: Owners | None = None) -> torch.Tensor:
        """CLS feature after the final norm, with this model's prompts inserted (``owners``: one pass, each sample
        with its own client's prompts, fedcore/engine/onepass.py)."""
        prompts = {i: p if owners is None else owners.expand(p) for i, p in enumerate(self.prompts)}
        mode = "replace" if self.prompt_mode == "deep" else "insert"
        return self.backbone.forward_tokens(x, prompts, mode=mode)[:, 0]

    def forward(self, x: torch.Tensor, owners: Owners | None = None) -> torch.Tensor:
        """Logits (``owners``: one pass, each sample through its own client's prompts and head)."""
        if owners is None:
            return self.head(self.features(x))
        return owners.linear(self.features(x, owners), self.head.weight, self.head.bias)


class PromptMethod(Method):
    """A method whose clients train a ``PromptClassifier`` (prompts of ``prompt_mode`` + a linear head)."""

    #: none | shallow (tokens before block 0) | deep (fresh tokens at every block)
    prompt_mode: ClassVar[str] = "none"

    def build(self, backbone: nn.Module) -> nn.Module:
        """The prompted classifier around ``backbone``."""
        return PromptClassifier(backbone, self.num_classes, self.prompt_mode, int(self.params.get("num_prompts", 0)))


def ce_losses(model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
    """Each client's cross-entropy of ``model(x, owners)`` on its own segment of a concatenated batch (one pass)."""
    return owners.per_client(F.cross_entropy, model(batch.x, owners), batch.y)


def prompt_one_pass(model: nn.Module, losses: Callable[[nn.Module, Batch, Owners], Tensor]) -> OnePass | None:
    """A prompted classifier's one pass: every state tensor (prompts, head, buffers such as a teacher) per client,
    read per sample by its forward; None for a model that cannot take ``owners`` (an entire trained backbone)."""
    return OnePass(losses) if isinstance(model, PromptClassifier) else None


class BatchableClient(Client):
    """The default update (CE epochs, fresh optimiser, nothing random in the loss): clients may train together, in one
    pass where the model is a prompted classifier, else vmapped."""

    def together(self, device: str, model: nn.Module) -> Together:
        """The generic paths of the default update (fedcore/engine/batching.py)."""
        return epochs_of_loss(self, device, model, one_pass=prompt_one_pass(model, ce_losses))


class VPTMethod(PromptMethod):
    """FedVPT's recipe (shallow or deep prompts of length ``num_prompts`` + head, FedAvg, clients trained
    together); prompt length 1 by default, SGPT spec 7.15, to match SGPT's prompt budget.

    The prompted ViT equals the VPT code's (KMnP/vpt, ``tests/test_official_vpt.py``). Kept from SGPT's recipe where
    the VPT code differs (DEVIATIONS.md, FedVPT / FedVPT-D): its default prompt length is 5; its head is an ``MLP``
    with kaiming-normal weights and bias -log(99) (ours: PyTorch's default ``Linear``); its SGD does not decay the
    head bias (ours decays every trained tensor)."""

    defaults = {"num_prompts": 1}
    param_rules = {"num_prompts": Int(1)}
    client_role = BatchableClient


class EveryClient(Strategy):
    """No server: every client trains every round and nothing is aggregated (Local)."""

    def select(self, info: RoundInfo, state: Payload) -> list[int]:
        """All clients, whatever the participation."""
        return list(range(info.num_clients))


class PersonalEvaluator(Evaluator):
    """Each client is scored with its own model: the downlink's tensors, then its personal ones."""

    personalized = True

    def one_pass(self, model: nn.Module) -> OnePassEval | None:
        """Prompted classifiers scored by the default ``predict``: every client's prompts and head read per sample, the
        clients scored together."""
        default = type(self).predict is Evaluator.predict
        return OnePassEval(prompt_logits) if default and isinstance(model, PromptClassifier) else None


@torch.no_grad()
def prompt_logits(model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
    """``Evaluator.predict`` of a concatenated batch, each segment with its own client's prompts and head."""
    with autocast_for(batch.x):
        return model(batch.x, owners).float()


# ---- methods that train the entire model ------------------------------------------------------------
INITS = ("pretrained", "random")
PROJECTIONS = ("linear", "pool")


def raw_backbone(adapter: nn.Module) -> nn.Module:
    """The raw backbone inside a prompt adapter (PromptedViT.vit / PromptedResNet.resnet)."""
    for attr in ("vit", "resnet"):
        if hasattr(adapter, attr):
            return getattr(adapter, attr)
    raise TypeError(f"{type(adapter).__name__} is not a PromptedViT or PromptedResNet adapter")


def random_weights(net: nn.Module) -> None:
    """Overwrite ``net``'s weights in place with a fresh draw of its architecture's own initialisation (the
    registry's builder, weights=None), from the global generator (the engine seeds it before ``build``)."""
    arch, tag = getattr(net, "fedcore_arch", None), getattr(net, "fedcore_tag", None)
    if arch is None:
        raise ValueError(f"{type(net).__name__} was not built by fedcore.backbones.registry: cannot redraw its weights")
    fresh = build_backbone(arch, weights=None, tag=tag)
    net.load_state_dict(fresh.state_dict())


class FeaturePool(nn.Module):
    """A parameter-free projection to ``width`` features: adaptive average pooling over the feature axis
    (HtFLlib's heterogeneous ResNets reach 512 features this way: ResNet-50's 2,048 become 512 means of 4)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, F) -> (B, width)."""
        return self.pool(x.unsqueeze(1)).squeeze(1)


class WholeModelClassifier(nn.Module):
    """The entire backbone (trainable, BatchNorm in train mode), an optional projection to a common feature
    width (heterogeneous clients sharing a head shape, as HtFLlib's models), and a linear head."""

    def __init__(self, net: nn.Module, feature_dim: int, num_classes: int, common_dim: int | None = None,
                 projection: str = "linear") -> None:
        super().__init__()
        self.net = net
        net.requires_grad_(True)
        self.proj: nn.Module = nn.Identity()
        if common_dim and common_dim != feature_dim:
            self.proj = nn.Linear(feature_dim, common_dim) if projection == "linear" else FeaturePool(common_dim)
        self.feature_dim = common_dim or feature_dim
        self.head = nn.Linear(self.feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The representation the head reads (the backbone's pooled feature, projected if needed)."""
        return self.proj(self.net(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.head(self.features(x))


class WholeModelMethod(Method):
    """A method whose clients train the entire model (backbone + head), from the pretrained weights or from a
    random draw of the architecture (``init``; FedHPL spec §8.15: the paper's baselines train from scratch).

    The backbone module is the run's private copy, taken out of its frozen adapter; clients sharing an
    architecture take turns on it and each keeps (or receives) its complete state, BatchNorm statistics included.
    ``common_dim`` (None: each backbone's own width) adds a projection so that clients of different widths share
    one feature width and head shape: a trained linear layer (``projection: linear``) or HtFLlib's parameter-free
    average pooling over the feature axis (``pool``; FedHPL Table 7's FedGen and FedTGP counts are exactly
    ResNet + head, so the paper's runs pooled).
    """

    defaults = {"init": "pretrained", "common_dim": None, "projection": "linear"}
    param_rules = {"init": Choice(INITS), "common_dim": Int(1, optional=True), "projection": Choice(PROJECTIONS)}

    @property
    def head_classes(self) -> int:
        """The head's output width (default: the dataset's classes; FedMD adds its public classes)."""
        return self.num_classes

    def build(self, backbone: nn.Module) -> nn.Module:
        """The trainable classifier around ``backbone``'s raw network."""
        return whole_model(backbone, self.head_classes, self.params["init"], self.params["common_dim"],
                           self.params.get("projection", "linear"))


def whole_model(backbone: nn.Module, num_classes: int, init: str, common_dim: int | None,
                projection: str = "linear") -> WholeModelClassifier:
    """The entire-model classifier around a prompt adapter's raw network: its weights as loaded
    (``init: pretrained``) or a fresh draw of the architecture (``random``), projected to ``common_dim``."""
    net = raw_backbone(backbone)
    if init == "random":
        random_weights(net)
    return WholeModelClassifier(net, int(backbone.feature_dim), num_classes,
                                None if common_dim is None else int(common_dim), projection)


# ---- prototype methods (FedProto, FedTGP): entire models whose per-class mean features are exchanged -----
PROTOS, PROTO_MASK = "protos", "proto_mask"  # buffers of a client's model: the downlink's global prototypes
PREDICTS = ("prototype", "head")


@dataclass(frozen=True)
class CommonDim(Constraint):
    """``common_dim``: null or an integer >= 1; null is refused when the run's backbones differ in feature width
    (prototypes of all clients must live in one space)."""

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        bad = Int(1, optional=True).violation(key, value, facts)
        if bad is not None or value is not None or facts is None:
            return bad
        dims = sorted({b.dim for b in facts.backbones})
        if len(dims) > 1:
            return Violation(key, value, "an integer >= 1",
                             f"the run's backbones have feature dims {dims}: prototypes need one common width")
        return None


def prototype_loss(features: Tensor, labels: Tensor, protos: Tensor, mask: Tensor) -> Tensor:
    """MSE of each feature to its class's global prototype, mean over batch x width (HtFLlib's ``MSELoss``);
    a sample whose class has no prototype (``mask`` 0) adds 0 but still counts in the mean, as there."""
    diff = (features - protos[labels]) * mask[labels][:, None]
    return diff.pow(2).mean()


def prototype_uplink(sums: Tensor, counts: Tensor, with_counts: bool = False) -> Payload:
    """Per present class its label and mean feature (float32), and its sample count when asked."""
    present = counts > 0
    up = {"labels": torch.nonzero(present).flatten(),
          "protos": (sums[present] / counts[present, None].to(sums.dtype)).float()}
    if with_counts:
        up["counts"] = counts[present].float()
    return up


def nearest_prototype_logits(features: Tensor, protos: Tensor, mask: Tensor) -> Tensor:
    """Minus the squared distance of each feature to each global prototype; -inf for classes without one."""
    dist = (features[:, None, :] - protos[None, :, :]).pow(2).sum(dim=2)
    return (-dist).masked_fill(mask[None, :] <= 0, float("-inf"))


class PrototypeClient(Client):
    """Entire model, CE + λ · prototype MSE (``lam``); nothing of the model leaves the client, the global
    prototypes arrive as two buffers of its model (so clients sharing a module keep their own)."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """Nothing of the model is sent to the server."""
        return []

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The whole model stays with the client; the prototype buffers come fresh with every downlink."""
        return [k for k in keys if k not in (PROTOS, PROTO_MASK)]

    def proto_loss(self, model: nn.Module, features: Tensor, labels: Tensor) -> Tensor:
        """CE of the head on ``features`` + λ · MSE to the global prototypes of the labels."""
        logits = model.head(features).float()
        return F.cross_entropy(logits, labels) + float(self.params["lam"]) * prototype_loss(
            features.float(), labels, getattr(model, PROTOS), getattr(model, PROTO_MASK))

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """See ``proto_loss``."""
        return self.proto_loss(model, model.features(batch.x), batch.y)

    @torch.no_grad()
    def class_sums(self, model: nn.Module, data: ClientData) -> tuple[Tensor, Tensor]:
        """(per-class feature sums (C, D) float64, counts (C,)) of one pass over the local data, eval mode."""
        was_training = model.training
        model.eval()
        c, d = self.method.num_classes, getattr(model, PROTOS).shape[1]
        device = getattr(model, PROTOS).device
        sums, counts = torch.zeros(c, d, dtype=torch.float64, device=device), torch.zeros(c, device=device)
        try:
            for b in data.plain_batches():
                with autocast_for(b.x):
                    feats = model.features(b.x)
                sums.index_add_(0, b.y, feats.double())
                add_counts(counts, b.y)
        finally:
            model.train(was_training)
        return sums, counts


class PrototypeEvaluator(PersonalEvaluator):
    """Each client's own model, predicting the nearest global prototype of its feature (``predict: prototype``,
    HtFLlib's test) or with its head (``predict: head``)."""

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> Tensor:
        """Logits: minus the distance to each global prototype, or the head's."""
        if self.params["predict"] == "head":
            return super().predict(model, batch)
        mask = getattr(model, PROTO_MASK)
        if not bool((mask > 0).any()):
            raise RuntimeError(f"method {self.method.name}: no global prototype to predict with "
                               "(no client has uploaded one yet)")
        with autocast_for(batch.x):
            feats = model.features(batch.x)
        return nearest_prototype_logits(feats.float(), getattr(model, PROTOS), mask)


class PrototypeMethod(WholeModelMethod):
    """An entire-model method (random init by default: FedHPL spec §8.15) whose clients exchange class
    prototypes of width ``common_dim`` (required when the clients' backbones differ in width)."""

    defaults: ClassVar[dict[str, Any]] = {**WholeModelMethod.defaults, "init": "random", "lam": 10.0,
                                          "predict": "prototype"}
    param_rules: ClassVar[dict[str, Constraint]] = {**WholeModelMethod.param_rules, "common_dim": CommonDim(),
                                                    "lam": Number(0.0), "predict": Choice(PREDICTS)}
    evaluator_role = PrototypeEvaluator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        widths = sorted({int(m.feature_dim) for m in self.models})
        if len(widths) > 1:
            raise ValueError(f"method_params.{self.name}: key 'common_dim' = None: the client models have feature "
                             f"widths {widths}; prototypes need one common width (set common_dim)")

    def build(self, backbone: nn.Module) -> nn.Module:
        """The entire classifier plus the global-prototype buffers its loss and prediction read."""
        model = super().build(backbone)
        model.register_buffer(PROTOS, torch.zeros(self.num_classes, model.feature_dim))
        model.register_buffer(PROTO_MASK, torch.zeros(self.num_classes))
        return model

    @property
    def proto_dim(self) -> int:
        """The prototypes' width (every client model's feature width)."""
        return int(self.models[0].feature_dim)


def per_class_sums(values: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """(sums (C, d) in float64, counts (C,) int64): per class the sum of the rows of ``values`` and their number
    (the uploads of FedHPL, FedHE and FedGH are built from these)."""
    sums = torch.zeros(num_classes, values.shape[1], dtype=torch.float64, device=values.device)
    sums.index_add_(0, labels, values.double())
    return sums, torch.bincount(labels, minlength=num_classes)


# ---- logit distillation (FedHPL, FedHE): per-class teacher logits reach each client as buffers of its model ----
TEACHER, TEACHER_MASK = "teacher", "teacher_mask"  # buffers of a client's model: its downlink


def with_teacher(model: nn.Module, num_classes: int) -> nn.Module:
    """Give ``model`` the buffers its distillation loss reads: the per-class teacher logits and which exist."""
    model.register_buffer(TEACHER, torch.zeros(num_classes, num_classes))
    model.register_buffer(TEACHER_MASK, torch.zeros(num_classes))
    return model


def distillation_loss(logits: Tensor, labels: Tensor, teacher: Tensor, mask: Tensor, temperature: float) -> Tensor:
    """Mean over the batch of KL(softmax(teacher[y]/T) ‖ softmax(logits/T)); 0 where mask[y] = 0 (no T² factor)."""
    log_student = F.log_softmax(logits / temperature, dim=1)
    target = F.softmax(teacher[labels] / temperature, dim=1)
    kl = F.kl_div(log_student, target, reduction="none").sum(dim=1)
    return (kl * mask[labels]).mean()


def kd_loss(logits: Tensor, labels: Tensor, teacher: Tensor, mask: Tensor, gamma: float,
            temperature: float) -> Tensor:
    """CE + γ · distillation towards the true class's teacher logit (FedHPL Eqs. 2, 9; FedHE)."""
    return F.cross_entropy(logits, labels) + gamma * distillation_loss(logits, labels, teacher, mask, temperature)


class DistillClient(Client):
    """Trains with ``distill_loss`` (``kd_loss``, params ``gamma``, ``temperature``) towards the downlink's teacher buffers; sends no
    model tensor and keeps its whole model; ``local_logits`` is the extra pass its upload is made from."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """Nothing of the model is sent to the server."""
        return []

    def personal_keys(self, keys: list[str]) -> list[str]:
        """Everything it trains stays with the client; the teacher buffers come fresh with every downlink."""
        return [k for k in keys if k not in (TEACHER, TEACHER_MASK)]

    def distill_loss(self, logits: Tensor, labels: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
        """CE + γ · distillation towards the true class's teacher logit (``kd_loss``; a method may override it)."""
        p = self.params
        return kd_loss(logits, labels, teacher, mask, float(p["gamma"]), float(p["temperature"]))

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """``distill_loss`` towards the downlink's teacher logits (loaded into the model's buffers)."""
        return self.distill_loss(model(batch.x).float(), batch.y, getattr(model, TEACHER),
                                 getattr(model, TEACHER_MASK))

    def client_losses(self, model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
        """``loss`` of each client on its own segment of a concatenated batch, towards its own teacher (one pass)."""
        logits = model(batch.x, owners).float()
        return torch.stack([self.distill_loss(z, y, t, m)
                            for z, y, t, m in zip(owners.split(logits), owners.split(batch.y),
                                                  owners.of(getattr(model, TEACHER)),
                                                  owners.of(getattr(model, TEACHER_MASK)))])

    @torch.no_grad()
    def local_logits(self, model: nn.Module, data: ClientData) -> tuple[Tensor, Tensor]:
        """(logits, labels) of every local training sample: one more pass, eval mode, no augmentation."""
        was_training = model.training
        model.eval()
        try:
            out = [(self.method.evaluator.predict(model, b), b.y) for b in data.plain_batches()]
        finally:
            model.train(was_training)
        return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
