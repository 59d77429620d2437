"""FedAMP (Huang et al., AAAI 2021): attentive message passing. The server builds, for each client, a personalised
cloud model u_i as an attention-weighted combination of the client models; each client trains its own model with
CE + (λ / 2α_k)·‖w − u_i‖²."""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Choice, Constraint, Int, Number
from fedcore.engine.optim import ClientData, TrainSettings, run_epochs
from fedcore.engine.roles import Client, FitResult, Payload, RoundInfo, Strategy
from fedcore.methods import register_method
from fedcore.methods.base import PersonalEvaluator, WholeModelMethod
from fedcore.methods.fedprox import proximal_term

ATTENTIONS = ("distance", "cosine")


def attention_weights(vectors: Tensor, attention: str, alpha_k: float, sigma: float,
                      self_weight: float | None = None) -> Tensor:
    """The (n, n) message-passing weights ξ of n clients' flattened models (rows sum to 1), in float64.

    ``distance`` (FedAMP, Eq. 5-6; PFLlib, Fling): ξ_ij = α_k·A'(‖w_i − w_j‖²) for j ≠ i with
    A'(x) = exp(−x/σ)/σ, and ξ_ii = 1 − Σ_{j≠i} ξ_ij. ``cosine`` (HeurFedAMP): ξ_ii = ``self_weight`` and
    ξ_ij = (1 − ξ_ii)·exp(σ·cos(w_i, w_j)) / Σ_{h≠i} exp(σ·cos(w_i, w_h)); a lone client gets ξ_ii = 1.
    """
    w = vectors.double()
    n = w.shape[0]
    gram = w @ w.T
    off = ~torch.eye(n, dtype=torch.bool, device=w.device)
    if attention == "distance":
        sq = gram.diagonal()
        dist = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0.0)
        xi = alpha_k * torch.exp(-dist / sigma) / sigma * off
        return xi + torch.diag(1.0 - xi.sum(dim=1))
    if attention == "cosine":
        if n == 1:
            return torch.ones(1, 1, dtype=torch.float64, device=w.device)
        norm = gram.diagonal().sqrt()
        cos = gram / (norm[:, None] * norm[None, :]).clamp_min(1e-300)
        logits = (sigma * cos).masked_fill(~off, -math.inf)
        xi = (1.0 - float(self_weight)) * torch.softmax(logits, dim=1)
        return xi + float(self_weight) * torch.eye(n, dtype=torch.float64, device=w.device)
    raise ValueError(f"attention must be one of {list(ATTENTIONS)}, got {attention!r}")


def alpha_at(params: dict[str, Any], round_idx: int) -> float:
    """α_k in round ``round_idx`` (1-indexed): ``alpha_k`` times ``alpha_decay`` once after round 31 and every
    ``alpha_decay_every`` rounds after that when the decay is on (Fling decays after its 0-indexed rounds
    30, 60, ...)."""
    every, decay = int(params["alpha_decay_every"]), float(params["alpha_decay"])
    return float(params["alpha_k"]) * decay ** (max(round_idx - 2, 0) // every)


def flatten(state: dict[str, Tensor], keys: list[str]) -> Tensor:
    """The named tensors concatenated in ``keys`` order (float32)."""
    return torch.cat([state[k].detach().reshape(-1).float() for k in keys])


def unflatten(vector: Tensor, like: dict[str, Tensor], keys: list[str]) -> dict[str, Tensor]:
    """``vector`` cut back into tensors shaped and typed like ``like``'s, in ``keys`` order."""
    out, pos = {}, 0
    for k in keys:
        n = like[k].numel()
        out[k] = vector[pos:pos + n].reshape(like[k].shape).to(like[k].dtype)
        pos += n
    return out


class FedAMPClient(Client):
    """Keeps its entire model; trains it with CE + (λ/2α_k)·‖w − u_i‖² over every parameter; uploads the
    parameters (BatchNorm statistics stay)."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The parameters (what the server's attention compares and combines)."""
        trainable = set(self.method.trainable_keys(0))
        return [k for k in keys if k in trainable]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The entire model, BatchNorm statistics included, stays with the client."""
        return list(keys)

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], dict | None]:
        """E epochs of CE + the proximal term towards the downlink's cloud model u_i, from the client's own w_i."""
        named = dict(model.named_parameters())
        keys = self.method.trainable_keys(cid)
        params = [named[k] for k in keys]
        anchor = [downlink["anchor"][k].to(named[k].device) for k in keys]
        mu = float(downlink["prox"])   # λ / α_k: proximal_term's μ/2 is then λ / (2 α_k)
        return run_epochs(params, data, settings, settings.local_epochs,
                          lambda b: F.cross_entropy(model(b.x), b.y) + proximal_term(params, anchor, mu))


class FedAMPServer(Strategy):
    """Keeps every client's latest uploaded parameters (one row each of a matrix) and the attention weights;
    sends client i its cloud model u_i = Σ_j ξ_ij w_j and the round's λ/α_k."""

    def _keys(self) -> list[str]:
        """The parameters, in the model's order."""
        return self.method.trainable_keys(0)

    def init_state(self, num_clients: int) -> Payload:
        """Every row the initial model, nobody heard from yet, ξ = identity (u_i = w_i = the initial model)."""
        keys = self._keys()
        device = next(self.method.model.parameters()).device   # the server computes where the models train
        init = flatten(self.method.initial_state(0, keys), keys).to(device)
        return {"vectors": init.repeat(num_clients, 1),
                "heard": torch.zeros(num_clients, dtype=torch.bool, device=device),
                "xi": torch.eye(num_clients, dtype=torch.float64, device=device), "round": 0}

    def configure(self, state: Payload, cid: int) -> Payload:
        """u_i (named tensors; a client nobody has heard from gets its own row: the initial model) and λ/α_k of the
        next round."""
        keys = self._keys()
        vectors = state["vectors"]
        u = state["xi"][cid].to(vectors) @ vectors
        p = self.params
        return {"anchor": unflatten(u, self.method.initial_state(cid, keys), keys),
                "prox": float(p["lam"]) / alpha_at(p, int(state["round"]) + 1)}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """Store the uploads, then ξ over every client heard from so far (α_k of this round)."""
        keys = self._keys()
        vectors, heard = state["vectors"].clone(), state["heard"].clone()
        for r in results:
            vectors[r.cid] = flatten(r.uplink["model"], keys).to(vectors.device)
            heard[r.cid] = True
        idx = torch.nonzero(heard).flatten()
        p = self.params
        xi = torch.eye(len(heard), dtype=torch.float64, device=vectors.device)
        xi[idx[:, None], idx[None, :]] = attention_weights(vectors[idx], p["attention"], alpha_at(p, info.round),
                                                           float(p["sigma"]), p["self_weight"])
        return {**state, "vectors": vectors, "heard": heard, "xi": xi, "round": info.round}


class OwnModelEvaluator(PersonalEvaluator):
    """Each client is scored with its own model w_i (no global model exists)."""

    def load(self, model: nn.Module, cid: int | None, server: Payload, client_state: Payload | None,
             data: ClientData | None) -> None:
        """The client's own model; for ``cid`` None nothing is loaded (there is no global model)."""
        if cid is not None:
            self.method.client.start(model, cid, client_state or {}, {})


@register_method
class FedAMP(WholeModelMethod):
    """FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang; "Personalized Cross-Silo Federated Learning on Non-IID
    Data", AAAI 2021) on the entire model.

    Each client keeps its entire model w_i (BatchNorm statistics included; all clients start from one initial
    model). In a round it trains w_i for E epochs with CE + (λ/2α_k)·‖w − u_i‖², the norm over every parameter,
    u_i its cloud model from the server, and uploads its parameters. The server keeps each client's latest
    upload and computes the attention weights ξ among all clients heard from (``attention_weights``:
    ``distance`` = FedAMP's A'(x) = exp(−x/σ)/σ with ξ_ii = 1 − Σ_j ξ_ij; ``cosine`` = HeurFedAMP); client i's
    next cloud model is u_i = Σ_j ξ_ij w_j. Round 1's (and a never-heard client's) u_i is the initial model.
    Evaluation: each client's own w_i (PFLlib and Fling test the client's model).

    Hyperparameters (defaults = PFLlib's, spec fedpft §4): α_k ``alpha_k`` 1, λ ``lam`` 1, σ ``sigma`` 1,
    ``attention: distance``, no α_k decay. The FedPFT authors' own FedAMP (Fling commit 8f1e924, cifar10 config)
    used α_k 10000, σ 100, λ 1 and α_k × 0.1 every 30 rounds (``alpha_decay: 0.1``, ``alpha_decay_every: 30``).
    ``self_weight`` (ξ_ii) is HeurFedAMP's and required with ``attention: cosine`` only.

    Where the sources differ or are silent:
    * The proximal term is λ/(2α_k)·‖w − u_i‖² with its gradient (the paper, Fling). PFLlib's ``clientamp.py``
      adds 0.5·λ/α_k·‖w − u‖ (not squared) computed from ``.data``, so it never reaches the gradient.
    * With partial participation the server combines the latest upload of every client heard from (PFLlib: the
      previous round's uploaders and the client's current model); FedPFT's FedAMP runs use full participation.
    * The distances and weights are computed in float64 from the float32 parameters.
    * The optimiser is the experiment's, fresh each round (Fling; PFLlib keeps one per client).
    """

    name = "fedamp"
    defaults: ClassVar[dict[str, Any]] = {**WholeModelMethod.defaults, "alpha_k": 1.0, "lam": 1.0, "sigma": 1.0,
                                          "attention": "distance", "self_weight": None, "alpha_decay": 1.0,
                                          "alpha_decay_every": 30}
    param_rules: ClassVar[dict[str, Constraint]] = {
        **WholeModelMethod.param_rules, "alpha_k": Number(0.0, lo_open=True), "lam": Number(0.0),
        "sigma": Number(0.0, lo_open=True), "attention": Choice(ATTENTIONS),
        "self_weight": Number(0.0, 1.0, optional=True), "alpha_decay": Number(0.0, 1.0, lo_open=True),
        "alpha_decay_every": Int(1)}
    client_role = FedAMPClient
    strategy_role = FedAMPServer
    evaluator_role = OwnModelEvaluator

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """``self_weight`` is HeurFedAMP's ξ_ii: required with ``attention: cosine``, refused with ``distance``."""
        cosine, given = params["attention"] == "cosine", params["self_weight"] is not None
        if cosine != given:
            raise ValueError(f"self_weight = {params['self_weight']!r} with attention = {params['attention']!r}: "
                             "self_weight (a number in [0, 1]) is required with attention: cosine and unused "
                             "with attention: distance (leave it null)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if len(self.models) != 1:
            raise ValueError(f"method_params.{self.name}: FedAMP combines client models tensor by tensor, so every "
                             f"client needs the same architecture; the run has {len(self.models)} backbones")
