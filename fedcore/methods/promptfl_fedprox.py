"""PromptFL + FedProx: PromptFL whose local loss adds (mu/2)||P - P_global||^2."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from fedcore.constraints import Number
from fedcore.engine.data import Batch
from fedcore.engine.onepass import Owners
from fedcore.methods import register_method
from fedcore.methods.clip_prompt import ClipClient, ClipPromptMethod
from fedcore.methods.fedprox import ProximalClient, proximal_term


class PromptProxClient(ProximalClient, ClipClient):
    """ClipClient's CE on the cached tokens + fedprox.ProximalClient's term over the prompt, anchored at the
    downlink's global prompt."""

    def client_losses(self, model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
        """One pass: each client's CE on its segment + its own proximal term (its prompts' rows, anchored at its rows
        as the round started), as ``ProximalClient.train`` adds them."""
        losses = ClipClient.client_losses(self, model, batch, owners)
        mu = float(self.params["mu"])
        if mu == 0.0:
            return losses
        names = self.method.trainable_keys(0)
        rows = list(zip(*(owners.of(getattr(model, n)) for n in names)))
        anchors = list(zip(*(owners.of(owners.start[n]) for n in names)))
        return losses + torch.stack([proximal_term(p, a, mu) for p, a in zip(rows, anchors, strict=True)])


@register_method
class PromptFLFedProx(ClipPromptMethod):
    """PromptFL + FedProx (spec fedotp §4.4): PromptFL (promptfl.py) whose clients minimise CE + (mu/2)||P - P_g||^2,
    P_g the global prompt received this round, mu ``mu`` 0.5 ([C] default).

    Choice (spec §8.3; DEVIATIONS.md, FedOTP): the proximal term really reaches the gradient (mu (P - P_g)); the
    official code computes it from ``state_dict()`` tensors, which carry no gradient, so its FedProx is PromptFL.
    With the optimiser's weight decay it acts on CE's gradient + mu (P - P_g) (FedProx's inexact local solver)."""

    name = "promptfl_fedprox"
    defaults = {**ClipPromptMethod.defaults, "mu": 0.5}
    param_rules = {**ClipPromptMethod.param_rules, "mu": Number(0.0)}
    client_role = PromptProxClient
