"""FedPer (Arivazhagan et al., 2019): the entire model trained jointly; the head stays with the client, the rest
(the extractor with its BatchNorm statistics) is averaged."""
from __future__ import annotations

from fedcore.methods import register_method
from fedcore.methods.base import BatchableClient, PersonalEvaluator, WholeModelMethod


def is_head(key: str) -> bool:
    """Whether a state key belongs to the linear head."""
    return key.startswith("head.")


class FedPerClient(BatchableClient):
    """E epochs of CE over the entire model; uploads everything but the head, keeps the head."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The base layers: extractor, its BatchNorm statistics, the projection if any."""
        return [k for k in keys if not is_head(k)]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The personalisation layer: the linear head."""
        return [k for k in keys if is_head(k)]


@register_method
class FedPer(WholeModelMethod):
    """FedPer (Arivazhagan, Aggarwal, Singh, Choudhary; arXiv 1912.00818) on the entire model.

    Base layers = the extractor (its parameters and BatchNorm running statistics) and the projection if any;
    personalisation layers = the linear head. Each round a client loads the global base and its own head,
    trains everything jointly with CE for E epochs (the experiment's optimiser, fresh each round), uploads the
    base and keeps the head; the server averages the base by sample count (FedAvg). Each client is scored
    with the global base (after aggregation) and its own head.

    Sources: FedPFT spec §4 (head personal, extractor incl. BN averaged); Fling's FedPer configs (the FedPFT
    authors' framework: aggregate every key except the classifier ``fc``, BatchNorm statistics included) and
    PFLlib's FedPer (``head`` personal, ``base`` averaged) agree, except that PFLlib averages parameters only: its
    clients keep their own BatchNorm statistics (tests/test_official_pfllib.py). FedPer has no hyperparameter of its
    own.
    Where they are silent: every client starts from the same initial head (PFLlib and Fling copy one model to
    every client); a client never sampled keeps it.
    """

    name = "fedper"
    client_role = FedPerClient
    evaluator_role = PersonalEvaluator
