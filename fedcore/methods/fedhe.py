"""FedHE: heterogeneous models, logit distillation without public data (Chan & Ngai, MSN 2021), as FedHPL
(spec fedhpl §5, Table 2) runs it: a Table 2 baseline on the heterogeneous ResNets, entire models from random init."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedcore.constraints import Choice, Number
from fedcore.engine.optim import ClientData
from fedcore.engine.roles import FitResult, Payload, RoundInfo, Strategy
from fedcore.methods import register_method
from fedcore.methods.base import (TEACHER, TEACHER_MASK, DistillClient, PersonalEvaluator, WholeModelMethod,
                                  kd_loss, per_class_sums, with_teacher)

WEIGHTINGS = ("clients", "samples")
DISTILLS = ("mse", "kl")


def class_means(logits: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """(per-class mean logit (C, C), zeros where a class is absent; per-class count (C,))."""
    sums, counts = per_class_sums(logits, labels, num_classes)
    counts = counts.double()
    return (sums / counts.clamp(min=1)[:, None]).float(), counts.float()


def aggregate_logits(means: Tensor, counts: Tensor, weighting: str) -> tuple[Tensor, Tensor]:
    """The global per-class logits (C, C) and mask (C,) from J clients' means (J, C, C) and counts (J, C).

    ``clients``: the plain mean over the clients that hold class c (HtFLlib FD); ``samples``: weighted by their
    counts (the mean of every class-c logit). A class nobody uploaded gets zeros and mask 0.
    """
    counts = counts.double()
    w = counts if weighting == "samples" else (counts > 0).double()
    total = w.sum(dim=0)
    glob = torch.einsum("jc,jcd->cd", w, means.double()) / total.clamp(min=1e-12)[:, None]
    return glob.float(), (total > 0).float()


def mse_distillation(logits: Tensor, labels: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """Mean over the batch of mean_c (teacher[y]_c − logits_c)², 0 where mask[y] = 0 (Keras' MeanSquaredError
    between the global logit of each sample's class and its raw logits, as the FedHe authors' client)."""
    return (((teacher[labels] - logits) ** 2).mean(dim=1) * mask[labels]).mean()


def fedhe_loss(logits: Tensor, labels: Tensor, teacher: Tensor, mask: Tensor, params: dict[str, Any]) -> Tensor:
    """CE + γ · distillation towards the true class's global logit: MSE on raw logits (``distill: mse``) or
    KL on softened ones (``kl``, with ``temperature``)."""
    gamma = float(params["gamma"])
    if params["distill"] == "kl":
        return kd_loss(logits, labels, teacher, mask, gamma, float(params["temperature"]))
    return F.cross_entropy(logits, labels) + gamma * mse_distillation(logits, labels, teacher, mask)


class FedHEClient(DistillClient):
    """CE + KD towards the global per-class logits; uploads its per-class mean logits and counts, no model tensor."""

    def distill_loss(self, logits: Tensor, labels: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
        """CE + γ · distillation towards the true class's global logit (``distill``: MSE or KL)."""
        return fedhe_loss(logits, labels, teacher, mask, self.params)

    def upload(self, model: nn.Module, cid: int, data: ClientData, stats: dict[str, float]) -> Payload:
        """Per class the mean logit and the count: n_c·(n_c + 1) numbers (Table 9: 110 / 10100)."""
        means, counts = class_means(*self.local_logits(model, data), self.method.num_classes)
        return {"logits": means, "counts": counts}


class FedHEServer(Strategy):
    """Averages the round's per-class logits into one global logit per class, the same for every client."""

    def init_state(self, num_clients: int) -> Payload:
        """No global logits yet (round 1 is CE only)."""
        c = self.method.num_classes
        return {"logits": torch.zeros(c, c), "mask": torch.zeros(c)}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global per-class logits and which classes have one."""
        return {"model": {TEACHER: state["logits"], TEACHER_MASK: state["mask"]}}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """The global logits from this round's uploads only."""
        if not results:
            return state
        means = torch.stack([r.uplink["logits"].cpu() for r in results])
        counts = torch.stack([r.uplink["counts"].cpu() for r in results])
        logits, mask = aggregate_logits(means, counts, self.params["weighting"])
        return {"logits": logits, "mask": mask}


@register_method
class FedHE(WholeModelMethod):
    """FedHE (Chan & Ngai, "FedHe: Heterogeneous Models and Communication-Efficient Federated Learning", MSN 2021).

    Trained: each client's entire model (its own architecture, ``client_backbones``; ``init: random`` for
    Table 2), with CE + γ · distillation towards the server's global logit of each sample's class. Uploaded: per
    class the mean logit and the count, n_c·(n_c + 1) numbers (Table 9: 110 / 10100); no model tensor leaves a
    client.
    Aggregated: one global logit per class, the mean of the round's uploads (``weighting``). Evaluated: each
    client's own model on the test set (``PersonalEvaluator``, spec §3.3).

    Choices where the paper (not available here) and the spec are silent, taken from the authors' code
    (github.com/ChanYunHin/FedHe, TF2, c2684c3) where it speaks:
    * KD (``distill: mse``, the default) is the authors' client term: γ · MSE between the global logit of each
      sample's class and the sample's raw logits (Keras' MeanSquaredError: the mean over classes, then over the
      batch; ``modules/Client.py`` ``train_step``), γ = 1 (their ``run_cifar10.sh`` ``--alpha 1``; the argument's
      default is 0.5). Until session 20 it was KL(softmax(p̃_y/T) ‖ softmax(p/T)) with T = 1, the reading of
      HtFLlib's FD (as of FedHPL's time it adds λ · CE(p, softmax(p̃_y)), the same gradient at T = 1); that
      remains ``distill: kl`` (with ``temperature``; mean over the batch, no T² factor).
    * A sample whose class has no global logit (round 1, or a class nobody uploaded this round) gets CE only
      (FD's fallback target, the sample's own detached softmax, also gives a zero KD gradient).
    * The uploaded logits come from one pass over the local train set after training, in eval mode (FedHPL's
      upload, spec §8.5); FD and the authors' client average the train-mode outputs seen during local training.
    * ``weighting: clients`` (FD's logit_aggregation): a plain mean over the clients that uploaded class c;
      ``samples``: weighted by their counts. Only the round's clients count, in synchronous rounds (FedHPL's
      protocol); the authors' server is asynchronous (it adds each finished client's means and replaces the sum
      by its average every 10·N updates).
    * A fresh optimiser every round (the engine's default, like FD), and FedHPL's shared protocol (its optimiser,
      lr, epochs, batch size), where the authors' script trains 3 minibatches of 50 per update with Adam at 1e-3.
    """

    name = "fedhe"
    defaults: dict[str, Any] = {**WholeModelMethod.defaults, "gamma": 1.0, "distill": "mse", "temperature": 1.0,
                                "weighting": "clients"}
    param_rules = {**WholeModelMethod.param_rules, "gamma": Number(0.0), "distill": Choice(DISTILLS),
                   "temperature": Number(0.0, lo_open=True), "weighting": Choice(WEIGHTINGS)}
    client_role = FedHEClient
    strategy_role = FedHEServer
    evaluator_role = PersonalEvaluator

    def build(self, backbone: nn.Module) -> nn.Module:
        """The entire-model classifier plus the buffers that carry the global logits."""
        return with_teacher(super().build(backbone), self.num_classes)


__all__ = ["FedHE", "aggregate_logits", "class_means", "fedhe_loss", "mse_distillation"]
