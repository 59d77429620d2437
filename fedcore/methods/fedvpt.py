"""FedVPT: VPT-shallow prompts at the first block's input plus a linear head, averaged by FedAvg."""
from __future__ import annotations

from fedcore.constraints import Int
from fedcore.methods.base import BatchableClient, PromptMethod


class FedVPT(PromptMethod):
    """Shallow visual prompts + head; SGPT spec 7.15 recommends prompt length 1 to match SGPT's budget."""

    name = "fedvpt"
    prompt_mode = "shallow"
    defaults = {"num_prompts": 1}
    param_rules = {"num_prompts": Int(1)}
    client_role = BatchableClient
