"""FedVPT-D: VPT-deep prompts (new tokens at every block, replacing the previous block's) + head, FedAvg."""
from __future__ import annotations

from fedcore.methods import register_method
from fedcore.methods.base import VPTMethod


@register_method
class FedVPTDeep(VPTMethod):
    """Deep visual prompts + head (prompt length 1 per block by default: SGPT spec 7.15)."""

    name = "fedvpt_d"
    prompt_mode = "deep"
