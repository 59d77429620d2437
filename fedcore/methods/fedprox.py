"""FedProx (Li et al., MLSys 2020): FedAvg whose local loss adds a proximal term (μ/2)·‖w − w_global‖²."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from fedcore.constraints import Number
from fedcore.engine.optim import ClientData, TrainSettings, run_epochs
from fedcore.engine.roles import Client, Payload
from fedcore.methods import register_method
from fedcore.methods.base import WholeModelMethod


def proximal_term(params: Sequence[Tensor], anchor: Sequence[Tensor], mu: float) -> Tensor:
    """(μ/2)·Σ_k ‖w_k − a_k‖² over the paired tensors (its gradient is μ(w − a))."""
    return 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))


class ProximalClient(Client):
    """A client whose loss adds ``proximal_term`` over every trainable tensor of its model, anchored at the
    tensors as the round starts (the downlink for shared ones, the client's own for personal ones). It reads
    ``params["mu"]`` and works for any model (entire model here, prompts for PromptFL + FedProx); μ = 0 is
    exactly the plain client."""

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], dict | None]:
        """``local_epochs`` epochs of loss + proximal term over the trainable tensors."""
        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        mu = float(self.params["mu"])
        opt_state = state.get("optimizer") if self.keep_optimizer else None
        if mu == 0.0:
            return run_epochs(params, data, settings, settings.local_epochs, lambda b: self.loss(model, b), opt_state)
        anchor = [p.detach().clone() for p in params]
        return run_epochs(params, data, settings, settings.local_epochs,
                          lambda b: self.loss(model, b) + proximal_term(params, anchor, mu), opt_state)


@register_method
class FedProx(WholeModelMethod):
    """FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith; MLSys 2020) on the entire model.

    Each client trains the entire model (backbone, BatchNorm statistics and head; ``init`` pretrained or a
    random draw, FedHPL spec §8.15: random) for E epochs of CE + (μ/2)·‖w − w_g‖², w_g = the global model it
    received; it uploads the entire model and the server averages it by sample count (FedAvg). The global
    model is evaluated (a loss-based method, FedHPL spec §3.3).

    Choices where the papers are silent:
    * μ = 0.01 (``mu``). FedHPL does not state it (spec §2); FedProx tunes μ over {0.001, 0.01, 0.1, 1} per
      dataset and PFLlib's default (0) is FedAvg. 0.01 is the middle of that grid, not a tuned value.
    * The term covers the trainable parameters only, not BatchNorm's running statistics (no gradient).
    * It enters the loss, so the experiment's optimiser (momentum, weight decay) acts on CE's gradient +
      μ(w − w_g), as FedProx's inexact local solver; the logged train loss includes it.
    * Every client uploads after its E epochs (no stragglers, no partial work γ-inexactness).
    * Fling (FLAIR-Community/Fling ``fedprox_client.py``, the FedPFT authors' framework) adds μ·Σ_k ‖w_k − w_g,k‖₂
      instead: per-tensor L2 norms, not squared, not halved (``torch_utils.get_model_difference``), so its pull
      has length μ per tensor whatever the distance. We keep the FedProx paper's (μ/2)·‖w − w_g‖²
      (tests/test_official_fling.py asserts the one-step difference). PFLlib's optimiser matches ours.
    """

    name = "fedprox"
    defaults = {**WholeModelMethod.defaults, "mu": 0.01}
    param_rules = {**WholeModelMethod.param_rules, "mu": Number(0.0)}
    client_role = ProximalClient
