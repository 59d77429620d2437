"""FedAvg (McMahan et al., AISTATS 2017): every client trains the entire model; the server averages it by
sample count and the global model is evaluated. Every role is the engine's default."""
from __future__ import annotations

from fedcore.methods import register_method
from fedcore.methods.base import WholeModelMethod


@register_method
class FedAvg(WholeModelMethod):
    """Entire-model FedAvg, from the pretrained backbone or a random draw (``init``)."""

    name = "fedavg"
