"""Evaluation every round: global, mean-local and worst-local accuracy, for global or personalised models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fedcore.engine.data import DeviceSplit, InputPipeline, iterate_batches


@dataclass
class EvalSets:
    """Where each client's local test set lives and what the global test set is."""

    source: DeviceSplit             # split the local test indices point into
    client_indices: list[torch.Tensor]
    official: DeviceSplit | None    # official test split when global_test == 'official_test'
    global_test: str                # 'pooled_local' | 'official_test'

    def __post_init__(self) -> None:
        # Predict each pooled image once, then read every client's correct count from it.
        self.pooled = torch.unique(torch.cat(self.client_indices)) if self.client_indices else None
        self._pos = {}
        if self.pooled is not None:
            lookup = torch.full((len(self.source.y),), -1, dtype=torch.long, device=self.pooled.device)
            lookup[self.pooled] = torch.arange(len(self.pooled), device=self.pooled.device)
            self._pos = {i: lookup[idx] for i, idx in enumerate(self.client_indices)}

    def positions(self, client: int) -> torch.Tensor:
        """Positions of a client's local test images inside ``pooled``."""
        return self._pos[client]


@torch.no_grad()
def predict(method, model, split: DeviceSplit, indices: torch.Tensor, pipeline: InputPipeline,
            batch_size: int) -> torch.Tensor:
    """Predicted labels for ``split`` at ``indices`` with ``model`` as it is loaded."""
    out = [method.evaluator.predict(model, b).argmax(dim=1)
           for b in iterate_batches(split, indices, batch_size, pipeline)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=indices.device)


def _client_correct(pred_pooled: torch.Tensor, sets: EvalSets, client: int) -> tuple[int, int]:
    """(correct, total) of one client's local test set from pooled predictions."""
    pos = sets.positions(client)
    labels = sets.source.y[sets.pooled[pos]]
    return int((pred_pooled[pos] == labels).sum()), len(pos)


def _global_acc(method, model, sets: EvalSets, pred_pooled: torch.Tensor, pipeline: InputPipeline,
                batch_size: int) -> float:
    """Accuracy of the loaded model on the global test set."""
    if sets.global_test == "official_test":
        idx = torch.arange(len(sets.official.y), device=sets.official.y.device)
        pred = predict(method, model, sets.official, idx, pipeline, batch_size)
        return float((pred == sets.official.y).float().mean())
    # pooled over the union of local test sets, each client's images counted as in its set (SGPT code)
    correct = total = 0
    for c in range(len(sets.client_indices)):
        k, n = _client_correct(pred_pooled, sets, c)
        correct, total = correct + k, total + n
    return correct / max(total, 1)


def evaluate_round(method, sets: EvalSets, pipeline: InputPipeline, batch_size: int,
                   load: Callable[[int | None], torch.nn.Module]) -> list[tuple[int, str, str, float]]:
    """Rows (client, split, metric, value) for one evaluated round; ``load(cid)`` loads and returns the model
    that scores client ``cid`` (``load(None)``: the global model)."""
    rows: list[tuple[int, str, str, float]] = []
    num_clients = len(sets.client_indices)
    local_acc: list[float] = []
    if not method.evaluator.personalized:
        model = load(None)
        pred = predict(method, model, sets.source, sets.pooled, pipeline, batch_size)
        for c in range(num_clients):
            k, n = _client_correct(pred, sets, c)
            local_acc.append(k / max(n, 1))
        global_acc = _global_acc(method, model, sets, pred, pipeline, batch_size)
    else:
        # each client's own model: local accuracy on its test set, global accuracy on the global test set
        global_accs = []
        for c in range(num_clients):
            model = load(c)
            pred = predict(method, model, sets.source, sets.pooled, pipeline, batch_size)
            k, n = _client_correct(pred, sets, c)
            local_acc.append(k / max(n, 1))
            global_accs.append(_global_acc(method, model, sets, pred, pipeline, batch_size))
            rows.append((c, "global", "acc", global_accs[-1]))
        global_acc = sum(global_accs) / num_clients
    for c, a in enumerate(local_acc):
        rows.append((c, "local", "acc", a))
    rows.append((-1, "global", "acc", global_acc))
    rows.append((-1, "local", "acc_mean", sum(local_acc) / num_clients))
    rows.append((-1, "local", "acc_worst", min(local_acc)))
    return rows
