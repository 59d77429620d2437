"""FedTGP: trainable global prototypes with adaptive-margin-enhanced contrastive learning (Zhang, Liu, Hua, Cao;
AAAI 2024); a Table 2 baseline of FedHPL (spec fedhpl §5), on the heterogeneous ResNets."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Int, Number
from fedcore.engine.optim import ClientData
from fedcore.engine.batching import epochs_of_loss
from fedcore.engine.roles import FitResult, Payload, RoundInfo, Strategy, Together
from fedcore.engine.sampling import stream_seed
from fedcore.methods import register_method
from fedcore.methods.base import PROTO_MASK, PROTOS, PrototypeClient, PrototypeMethod, prototype_uplink

GENERATOR = ("embedding", "w1", "b1", "w2", "b2")  # server-state tensors of G_p
SERVER_STREAM = 16  # stream_seed stream of the server's batch order (clients use 0..3)


# ---- the prototype generator G_p ------------------------------------------------------------------------
def init_generator(num_classes: int, dim: int) -> dict[str, Tensor]:
    """G_p's tensors with PyTorch's default init (Embedding N(0, 1), Linear Kaiming-uniform), hidden width =
    ``dim`` (HtFLlib), drawn from the global generator on the CPU."""
    emb, fc1, fc2 = nn.Embedding(num_classes, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
    tensors = (emb.weight, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    return {k: t.detach().clone() for k, t in zip(GENERATOR, tensors, strict=True)}


def generate(gen: dict[str, Tensor], classes: Tensor) -> Tensor:
    """G_p(c) = W2 · relu(W1 · e_c + b1) + b2 for each class id."""
    hidden = F.relu(F.linear(gen["embedding"][classes], gen["w1"], gen["b1"]))
    return F.linear(hidden, gen["w2"], gen["b2"])


def adaptive_margin(means: Tensor, present: Tensor, threshold: float) -> float:
    """δ = min(max over present classes of the distance to the nearest other present class, τ) (FedTGP's
    adaptive margin; HtFLlib computes it from the per-class client-mean prototypes); τ when < 2 classes."""
    idx = torch.nonzero(present).flatten()
    if len(idx) < 2:
        return float(threshold)
    dist = torch.cdist(means[idx].double(), means[idx].double())
    dist.fill_diagonal_(float("inf"))
    return min(float(dist.min(dim=1).values.max()), float(threshold))


def generator_loss(protos: Tensor, labels: Tensor, generated: Tensor, margin: float) -> Tensor:
    """CE over classes of -(‖q - G_p(c)‖ + δ·[c = y]): the uploaded prototype q is pulled to its class's
    generated prototype and pushed at least δ closer to it than to the others."""
    dist = torch.linalg.vector_norm(protos[:, None, :] - generated[None, :, :], dim=2)
    dist = dist + margin * F.one_hot(labels, generated.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


# ---- roles ------------------------------------------------------------------------------------------------
class FedTGPClient(PrototypeClient):
    """CE + λ · MSE to the generated global prototypes; uploads each class's mean feature after training."""

    def together(self, device: str, model: nn.Module) -> Together:
        """The update is the default epochs of ``loss`` (prototypes in buffers, nothing random): clients of one
        architecture may train together."""
        return epochs_of_loss(self, device, model)

    def upload(self, model: nn.Module, cid: int, data: ClientData, stats: dict[str, float]) -> Payload:
        """Per class present, its label and the mean feature of one more pass over the data (eval mode)."""
        return prototype_uplink(*self.class_sums(model, data))


class FedTGPServer(Strategy):
    """Trains G_p on the round's uploaded prototypes; its outputs are the next global prototypes."""

    def init_state(self, num_clients: int) -> Payload:
        """A fresh G_p; no global prototype yet (round 1 is CE only)."""
        c, device = self.method.num_classes, self.method.models[0].head.weight.device
        gen = {k: v.to(device) for k, v in init_generator(c, self.method.proto_dim).items()}
        return {"generator": gen, "protos": torch.zeros(c, self.method.proto_dim, device=device),
                "mask": torch.zeros(c, device=device), "margin": torch.zeros((), device=device)}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global prototypes (loaded into the client model's buffers)."""
        return {"model": {PROTOS: state["protos"], PROTO_MASK: state["mask"]}}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """``server_epochs`` epochs of SGD on G_p over the uploaded (prototype, label) pairs, shuffled each epoch
        in minibatches of ``server_batch_size``, margin from this round's uploads; then G_p(c) for every class."""
        if not results:
            return state
        p, c = self.params, self.method.num_classes
        device = state["protos"].device
        protos = torch.cat([r.uplink["protos"].to(device) for r in results]).float()
        labels = torch.cat([r.uplink["labels"].to(device) for r in results]).long()
        sums = torch.zeros(c, protos.shape[1], device=device).index_add_(0, labels, protos)
        counts = torch.bincount(labels, minlength=c).float()
        means = sums / counts.clamp(min=1)[:, None]             # per class the mean over the clients that have it
        margin = adaptive_margin(means, counts > 0, float(p["margin_threshold"]))
        gen = {k: v.detach().clone().requires_grad_(True) for k, v in state["generator"].items()}
        opt = torch.optim.SGD(list(gen.values()), lr=float(p["server_lr"]))  # fresh each round, as HtFLlib
        order = torch.Generator(device="cpu").manual_seed(stream_seed(info.seed, info.round, 0, SERVER_STREAM))
        classes, bs = torch.arange(c, device=device), int(p["server_batch_size"])
        with torch.enable_grad():
            for _ in range(int(p["server_epochs"])):
                perm = torch.randperm(len(labels), generator=order).to(device)
                for i in range(0, len(perm), bs):
                    idx = perm[i:i + bs]
                    loss = generator_loss(protos[idx], labels[idx], generate(gen, classes), margin)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        gen = {k: v.detach() for k, v in gen.items()}
        with torch.no_grad():
            new = generate(gen, classes)
        return {"generator": gen, "protos": new, "mask": torch.ones(c, device=device),
                "margin": torch.tensor(margin, device=device)}


@register_method
class FedTGP(PrototypeMethod):
    """FedTGP (Zhang, Liu, Hua, Cao; AAAI 2024), as HtFLlib runs it.

    Trained: each client's entire model (its own architecture, ``init: random`` by default: FedHPL spec §8.15;
    BatchNorm in train mode), projected to ``common_dim`` (HtFLlib's ``feature_dim`` 512 at paper scale), then
    a linear head. Loss per batch: CE(head(f), y) + λ · MSE(f, G_p(y)) (λ = ``lam`` = 10, HtFLlib; MSE a mean
    over batch x width; round 1, before any G_p output, CE only). Fresh optimiser each round (HtFLlib); clients
    of one architecture may train together (the update is the default one).
    Uploaded: per class present locally its label and the mean feature of one extra pass over the local data
    after training (eval mode, no gradient; HtFLlib's ``collect_protos``, which there reads the model saved before
    the round's update: its uploads lag a round, ours do not; the FedTGP authors' own repository has the same
    client file; DEVIATIONS.md). No model tensor leaves a client.
    Server: G_p = class embedding (C x D) -> Linear(D, D) -> ReLU -> Linear(D, D), D = the common width (HtFLlib;
    Table 9's 0.506 M / 0.550 M at D = 512 with 10 / 100 classes). Each round, margin δ = min(max_c min_{c'≠c}
    ‖Q̄_c - Q̄_c'‖, τ) with Q̄ the per-class mean of the round's uploads over the clients that have the class and
    τ = ``margin_threshold`` = 100; then ``server_epochs`` = 100 epochs of plain SGD (lr ``server_lr``) over the
    round's (prototype, label) pairs, reshuffled every epoch (seeded by run seed and round), minibatches of
    ``server_batch_size``, loss CE(-(‖q - G_p(c)‖ + δ·[c = y]), y). The next global prototypes are G_p(c) for
    every class (classes nobody uploaded included, as HtFLlib). G_p, the prototypes and δ are the server state.
    Evaluation (FedHPL spec §3.3, personalised): each client's own model on the full test set, predicting the
    nearest global prototype (HtFLlib's test), or with ``predict: head`` its head.
    Where the paper is silent: server lr and batch size are HtFLlib's (the clients' lr and batch size: defaults
    0.01 and 16, FedHPL's values; set them to the experiment's); distances use ``vector_norm`` of the difference
    (HtFLlib expands ‖a‖² - 2ab + ‖b‖², the same up to rounding, without its NaN at a negative rounding).
    ResNet50's 2048 features reach the common width through HtFLlib's parameter-free ``AdaptiveAvgPool1d``
    (``projection: pool`` in FedHPL's experiments; Table 7's FedTGP row, 22.424 M on R50, is exactly that model)
    or a trained Linear (``projection: linear``, the default of every whole-model method).
    The experiment's optimiser (FedHPL §2: momentum 0.9, weight decay) on the clients, where HtFLlib's use
    plain SGD at the same lr.
    """

    name = "fedtgp"
    defaults: dict[str, Any] = {**PrototypeMethod.defaults, "server_epochs": 100, "margin_threshold": 100.0,
                                "server_lr": 0.01, "server_batch_size": 16}
    param_rules = {**PrototypeMethod.param_rules, "server_epochs": Int(0), "margin_threshold": Number(0.0),
                   "server_lr": Number(0.0, lo_open=True), "server_batch_size": Int(1)}
    client_role = FedTGPClient
    strategy_role = FedTGPServer


__all__ = ["FedTGP", "adaptive_margin", "generate", "generator_loss", "init_generator"]
