"""FedRoD (Chen, Chao; ICLR 2022): a shared body and generic head trained with the balanced-softmax loss, plus a
personal head; a client predicts with the sum of both heads' logits."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Constraint, Flag
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for
from fedcore.engine.roles import Client, Payload
from fedcore.methods import register_method
from fedcore.methods.base import PersonalEvaluator, WholeModelMethod

PERSONAL_HEAD, COUNTS = "phead", "class_counts"  # the personal head module and the label-count buffer


def balanced_softmax_loss(logits: Tensor, labels: Tensor, counts: Tensor) -> Tensor:
    """CE of ``logits + log(n_c)`` (Ren et al. 2020's balanced softmax; FedRoD's L_BR): the logits are shifted
    by the log of the client's per-class training counts (a class it has none of gets -inf)."""
    return F.cross_entropy(logits.float() + counts.float().log()[None, :], labels)


@torch.no_grad()
def label_counts(data: ClientData, num_classes: int) -> Tensor:
    """Per-class counts (float) of every training sample of the client (``plain_batches``; outside a run the pass
    draws from the client's generator, restored after it, so training sees the very batches it would have seen)."""
    saved = data.generator.get_state()
    try:
        labels = [b.y for b in data.plain_batches()]
    finally:
        data.generator.set_state(saved)
    return torch.bincount(torch.cat(labels), minlength=num_classes).float()


def rod_logits(model: nn.Module, x: Tensor, detach_personal: bool = True) -> tuple[Tensor, Tensor]:
    """(generic logits, personalised logits): g = h_G(z) and g.detach() + h_P(z), z the body's feature (detached
    for h_P when ``detach_personal``)."""
    z = model.features(x)
    g = model.head(z)
    p = getattr(model, PERSONAL_HEAD)(z.detach() if detach_personal else z)
    return g, g.detach() + p


class FedRoDClient(Client):
    """One optimiser over the summed loss L_BR(generic) + CE(personalised); uploads body and generic head."""

    @staticmethod
    def _personal(key: str) -> bool:
        """Whether a state key stays with the client."""
        return key.startswith(PERSONAL_HEAD + ".") or key == COUNTS

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The body (with its BatchNorm statistics and projection) and the generic head."""
        return [k for k in keys if not self._personal(k)]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The personal head and the client's label counts."""
        return [k for k in keys if self._personal(k)]

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], dict | None]:
        """Count the client's labels once (first round it trains), then E epochs of ``loss``."""
        counts = getattr(model, COUNTS)
        if float(counts.sum()) == 0:
            counts.copy_(label_counts(data, self.method.num_classes))
        return super().train(model, cid, state, downlink, data, settings)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """L_BR of the generic head + CE of the personalised logits. Their gradients touch disjoint tensors
        (body and h_G get L_BR's only, h_P CE's only), so one optimiser equals one per part."""
        g, p = rod_logits(model, batch.x, bool(self.params["detach_personal"]))
        return balanced_softmax_loss(g, batch.y, getattr(model, COUNTS)) + F.cross_entropy(p.float(), batch.y)


class FedRoDEvaluator(PersonalEvaluator):
    """Each client: the global body and generic head with its own personal head; predicts g + h_P."""

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> Tensor:
        """The personalised logits."""
        with autocast_for(batch.x):
            return rod_logits(model, batch.x)[1].float()


@register_method
class FedRoD(WholeModelMethod):
    """FedRoD (Chen, Chao; "On Bridging Generic and Personalized Federated Learning for Image Classification",
    ICLR 2022), the linear-personal-head version, on the entire model.

    Shared (averaged by sample count, FedAvg): the body (extractor with its BatchNorm statistics, the projection
    if any) and the generic head h_G. Personal: the head h_P (same shape) and the client's per-class training
    counts n_c. Each round a client trains, with one instance of the experiment's optimiser (fresh each round),
    the sum of the balanced-softmax loss of h_G (CE of h_G(z) + log n_c; updates body and h_G) and CE of the
    personalised logits h_G(z).detach() + h_P(z.detach()) (updates h_P only). It is scored with
    argmax h_G(z) + h_P(z): the global body and h_G after aggregation, its own h_P.

    Sources: the FedRoD paper (L_BR for body and generic head, empirical risk for the personal head; prediction
    = generic + personal logits); PFLlib's ``clientrod.py`` (the same losses; h_P on detached features; h_P
    starts as a copy of h_G's initial weights); Fling's FedRoD (the FedPFT authors' framework) uses the same
    losses and one optimiser over their sum, but lets the personal CE reach the body (``detach_personal:
    false`` runs that). No hyperparameter of its own (the hypernetwork variant of the paper is not built).

    Where the sources are silent or differ:
    * One optimiser (the experiment's) over the summed loss; PFLlib steps h_P with a second, plain SGD at the
      same lr (no momentum), Fling with the same one.
    * n_c: counted once, over every training sample of the client (``ClientData.plain_batches``: one pass in
      order, no augmentation) the first round it trains, kept in the client's state. A class with n_c = 0 gets
      logit -inf in L_BR (PFLlib, Fling).
    """

    name = "fedrod"
    defaults: ClassVar[dict[str, Any]] = {**WholeModelMethod.defaults, "detach_personal": True}
    param_rules: ClassVar[dict[str, Constraint]] = {**WholeModelMethod.param_rules, "detach_personal": Flag()}
    client_role = FedRoDClient
    evaluator_role = FedRoDEvaluator

    def build(self, backbone: nn.Module) -> nn.Module:
        """The entire classifier plus the personal head (initialised as a copy of the generic head, PFLlib) and the
        label-count buffer (zeros until the client counts its data)."""
        model = super().build(backbone)
        personal = nn.Linear(model.head.in_features, model.head.out_features)
        personal.load_state_dict(model.head.state_dict())
        setattr(model, PERSONAL_HEAD, personal)
        model.register_buffer(COUNTS, torch.zeros(model.head.out_features))
        return model
