"""FedVPT-D: VPT-deep prompts (new tokens at every block, replacing the previous block's) + head, FedAvg."""
from __future__ import annotations

from fedcore.constraints import Int
from fedcore.methods.base import BatchableClient, PromptMethod


class FedVPTDeep(PromptMethod):
    """Deep visual prompts + head; prompt length 1 per block by default (SGPT spec 7.15)."""

    name = "fedvpt_d"
    prompt_mode = "deep"
    defaults = {"num_prompts": 1}
    param_rules = {"num_prompts": Int(1)}
    client_role = BatchableClient
