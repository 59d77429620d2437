"""FedProto: federated prototype learning across heterogeneous clients (Tan et al., AAAI 2022); a Table 2
baseline of FedHPL (spec fedhpl §5), on the heterogeneous ResNets."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedcore.constraints import Choice
from fedcore.engine.aggregation import add_counts
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings, run_epochs
from fedcore.engine.roles import FitResult, Payload, RoundInfo, Strategy, module_state
from fedcore.methods import register_method
from fedcore.methods.base import PROTO_MASK, PROTOS, PrototypeClient, PrototypeMethod, prototype_uplink

WEIGHTINGS = ("clients", "samples")


def average_prototypes(uplinks: list[Payload], num_classes: int, dim: int, weighting: str,
                       device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(global prototypes (C, D), mask (C,)): per class the mean of the uploaded prototypes of that class, each
    client weighing 1 (``clients``) or its class count (``samples``); mask 0 where no client uploaded the class."""
    num = torch.zeros(num_classes, dim, dtype=torch.float64, device=device)
    den = torch.zeros(num_classes, dtype=torch.float64, device=device)
    for up in uplinks:
        labels = up["labels"].to(device)
        w = (up["counts"].to(device, torch.float64) if weighting == "samples"
             else torch.ones(len(labels), dtype=torch.float64, device=device))
        num.index_add_(0, labels, up["protos"].to(device, torch.float64) * w[:, None])
        den.index_add_(0, labels, w)
    protos = torch.where(den[:, None] > 0, num / den.clamp(min=1e-300)[:, None], torch.zeros_like(num))
    return protos.float(), (den > 0).float()


class FedProtoClient(PrototypeClient):
    """CE + λ · MSE to the global prototypes; uploads the mean feature of each class seen while training."""

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """Local epochs of the loss, summing each batch's (detached) features per class on the way, as HtFLlib
        collects the local prototypes; the uplink holds only those means (and labels)."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        protos = getattr(model, PROTOS)
        c, device = self.method.num_classes, protos.device
        sums = torch.zeros(c, protos.shape[1], dtype=torch.float64, device=device)
        counts = torch.zeros(c, device=device)

        def loss(batch: Batch) -> Tensor:
            feats = model.features(batch.x)
            with torch.no_grad():
                sums.index_add_(0, batch.y, feats.detach().double())
                add_counts(counts, batch.y)
            return self.proto_loss(model, feats, batch.y)

        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        stats, _ = run_epochs(params, data, settings, settings.local_epochs, loss)
        new_state = {**state, "model": module_state(model, self.personal_keys(self.method.keys(cid)))}
        uplink = prototype_uplink(sums, counts, with_counts=self.params["weighting"] == "samples")
        return new_state, FitResult(cid, data.num_samples, uplink, stats)


class FedProtoServer(Strategy):
    """Averages the uploaded prototypes per class; no model on the server."""

    def init_state(self, num_clients: int) -> Payload:
        """No global prototype yet: round 1 is CE only."""
        c, device = self.method.num_classes, self.method.models[0].head.weight.device
        return {"protos": torch.zeros(c, self.method.proto_dim, device=device), "mask": torch.zeros(c, device=device)}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global prototypes and which classes have one (loaded into the client model's buffers)."""
        return {"model": {PROTOS: state["protos"], PROTO_MASK: state["mask"]}}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """The round's uploads replace the global prototypes (a class nobody uploaded this round has none)."""
        protos, mask = average_prototypes([r.uplink for r in results], self.method.num_classes,
                                          self.method.proto_dim, self.params["weighting"], state["protos"].device)
        return {"protos": protos, "mask": mask}


@register_method
class FedProto(PrototypeMethod):
    """FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang; AAAI 2022), as HtFLlib runs it.

    Trained: each client's entire model (its own architecture, ``init: random`` by default: FedHPL spec §8.15;
    BatchNorm in train mode), projected to ``common_dim`` (HtFLlib's ``feature_dim`` 512 at paper scale) so that
    all prototypes share one width, then a linear head. Loss per batch: CE(head(f), y) + λ · MSE(f, P̄_y) with
    f the projected feature, P̄ the global prototypes, λ = ``lam`` = 10 (HtFLlib's pre-tuned value; FedProto's
    code defaults ``--ld`` to 1), the MSE a mean over batch x width; a sample of a class without a global
    prototype adds no MSE (round 1: CE only).
    The experiment's optimiser (FedHPL §2: SGD with momentum 0.9 and weight decay), fresh each round (HtFLlib:
    a fresh plain SGD at the same lr; FedProto's code: a fresh SGD with momentum 0.5).
    Uploaded: per class present locally its label and the mean of the features computed while training (every
    batch of every local epoch, detached, train mode), as HtFLlib collects them (FedProto's official code
    restarts its lists every local epoch and so keeps the last epoch's: the same at E = 1); with
    ``weighting: samples`` also the class counts. No model tensor leaves a client.
    Aggregated: per class the mean of the round's uploaded prototypes; ``weighting: clients`` (default) weighs
    each client 1 (FedProto's code, HtFLlib), ``samples`` by its class count (the paper's Eq. weights clients by
    |D_{i,j}|; the paper text is not among this project's sources, so this is the count-weighted mean). The
    round's uploads replace the global prototypes; a class nobody uploaded has none.
    Evaluation (FedHPL spec §3.3, personalised): each client's own model on the full test set, predicting the
    nearest global prototype of its feature (squared Euclidean; HtFLlib's test), or with ``predict: head``
    its head. FedProto's code tests each client on a test split of its own classes only and scores only those
    classes' prototypes (``lib/update.py`` ``test_inference_new_het_lt``; FedHPL App. C.3 names this split as why
    its FedProto numbers differ from the paper's), and the accuracies it prints accumulate over the clients.
    The prototype is the feature the head reads (HtFLlib's); FedProto's code takes its CNNs' ReLU'd ``fc1``
    output (dropout follows) and its CIFAR ResNet18's unpooled layer-4 map.
    ResNet50's 2048 features reach the common width through our Linear (``common_dim``); HtFLlib's models use
    a parameter-free ``AdaptiveAvgPool1d`` for every client. Table 7's FedProto row (1 M more on each client)
    matches neither.
    """

    name = "fedproto"
    defaults: dict[str, Any] = {**PrototypeMethod.defaults, "weighting": "clients"}
    param_rules = {**PrototypeMethod.param_rules, "weighting": Choice(WEIGHTINGS)}
    client_role = FedProtoClient
    strategy_role = FedProtoServer


__all__ = ["FedProto", "average_prototypes"]
