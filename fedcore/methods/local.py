"""Local: every client trains its own model on its own data (prompts + head, or the entire model); nothing is
communicated."""
from __future__ import annotations

from fedcore.methods import register_method
from fedcore.methods.base import BatchableClient, EveryClient, PersonalEvaluator
from fedcore.methods.representation import PromptsOrBackbone


class LocalClient(BatchableClient):
    """Keeps everything it trains; sends nothing."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """Nothing is sent to the server."""
        return []

    def personal_keys(self, keys: list[str]) -> list[str]:
        """Every state tensor stays with its client."""
        return list(keys)


@register_method
class Local(PromptsOrBackbone):
    """No-communication baseline, evaluated per client with its own model.

    ``representation: prompts`` (default, SGPT's setting): VPT-shallow prompts + head on the frozen ViT.
    ``representation: backbone`` (FedPFT's "Local", spec fedpft §3-§4): the entire extractor + a linear head,
    trained, from the backbone's weights or a random draw (``init``; FedPFT's ``scratch: true`` extractors are
    already a seeded random draw, so ``pretrained`` = as built), its BatchNorm statistics part of the
    client's model. Every client starts from the same initial model (PFLlib's Local copies one global model
    to every client).

    Every client trains every round (participation does not apply: there is no server to talk to),
    so each client gets ``rounds * local_epochs`` epochs, the usual reading of a Local baseline.
    The optimiser is the experiment's, fresh every round (as in Fling, the FedPFT authors' framework; PFLlib
    keeps one optimiser per client across rounds).
    """

    name = "local"
    client_role = LocalClient
    strategy_role = EveryClient
    evaluator_role = PersonalEvaluator
