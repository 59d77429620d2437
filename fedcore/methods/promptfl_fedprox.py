"""PromptFL + FedProx: PromptFL whose local loss adds (mu/2)||P - P_global||^2."""
from __future__ import annotations

from fedcore.constraints import Number
from fedcore.methods import register_method
from fedcore.methods.clip_prompt import ClipClient, ClipPromptMethod
from fedcore.methods.fedprox import ProximalClient


class PromptProxClient(ProximalClient, ClipClient):
    """ClipClient's CE on the cached tokens + fedprox.ProximalClient's term over the prompt, anchored at the
    downlink's global prompt."""


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
