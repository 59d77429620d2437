"""Local: every client trains its own prompts and head on its own data; nothing is communicated."""
from __future__ import annotations

from torch import nn

from fedcore.methods.base import Method, PromptClassifier


class Local(Method):
    """No-communication baseline: VPT-shallow prompts + head per client, evaluated per client.

    Every client trains every round (participation does not apply: there is no server to talk to),
    so each client gets ``rounds * local_epochs`` epochs, the usual reading of a Local baseline.
    """

    name = "local"
    personalized = True
    train_all_clients = True
    batched_clients = True
    defaults = {"num_prompts": 1}

    def build(self) -> nn.Module:
        """Same model as FedVPT, but owned by each client."""
        return PromptClassifier(self.backbone, self.num_classes, "shallow", self.params["num_prompts"])

    def shared_names(self) -> list[str]:
        """Nothing is sent to the server."""
        return []

    def personal_names(self) -> list[str]:
        """Every trainable tensor stays with its client."""
        return self.trainable_names()
