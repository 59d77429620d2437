"""Local: every client trains its own prompts and head on its own data; nothing is communicated."""
from __future__ import annotations

from fedcore.constraints import Int
from fedcore.methods.base import BatchableClient, EveryClient, PersonalEvaluator, PromptMethod


class LocalClient(BatchableClient):
    """Keeps everything it trains; sends nothing."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """Nothing is sent to the server."""
        return []

    def personal_keys(self, keys: list[str]) -> list[str]:
        """Every state tensor stays with its client."""
        return list(keys)


class Local(PromptMethod):
    """No-communication baseline: VPT-shallow prompts + head per client, evaluated per client.

    Every client trains every round (participation does not apply: there is no server to talk to),
    so each client gets ``rounds * local_epochs`` epochs, the usual reading of a Local baseline.
    """

    name = "local"
    prompt_mode = "shallow"
    defaults = {"num_prompts": 1}
    param_rules = {"num_prompts": Int(1)}
    client_role = LocalClient
    strategy_role = EveryClient
    evaluator_role = PersonalEvaluator
