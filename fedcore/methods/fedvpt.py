"""FedVPT: VPT-shallow prompts at the first block's input plus a linear head, averaged by FedAvg."""
from __future__ import annotations

from fedcore.methods import register_method
from fedcore.methods.base import VPTMethod


@register_method
class FedVPT(VPTMethod):
    """Shallow visual prompts + head (prompt length 1 by default: SGPT spec 7.15)."""

    name = "fedvpt"
    prompt_mode = "shallow"
