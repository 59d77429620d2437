"""Evaluation every round: global, mean-local and worst-local accuracy, for global or personalised models.

``global_test`` none (FedOTP, FedPFT: their tables read the clients' own test sets only): no global accuracy, and
each personalised model scores its own client's test set only, not every client's (100x less work at 100 clients).

With ``per_class`` (the experiment's ``evaluation.per_class``) it also gives the accuracy on each class's
images of the global test set, ``acc_class<k>``: per client for personalised models, and for client -1 the
global model's (or, personalised, the mean over the clients of theirs; a class absent from the set is NaN).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from fedcore.engine.batching import OnePassEval, check_alike, one_pass_on
from fedcore.engine.data import DeviceSplit, InputPipeline, iterate_batches
from fedcore.engine.onepass import Owners, concat_batches, evaluation_scope, with_stacked
from fedcore.engine.precision import rules_device
from fedcore.engine.roles import module_state

#: at most this many clients' copies of an evaluation batch go through one pass (personalised models scored together)
CLIENTS_PER_PASS = 8


@dataclass
class EvalSets:
    """Where each client's local test set lives and what the global test set is."""

    source: DeviceSplit             # split the local test indices point into
    client_indices: list[torch.Tensor]
    official: DeviceSplit | None    # the dataset's whole test split (global accuracy reads it when global_test == 'official_test')
    global_test: str                # 'pooled_local' | 'official_test' | 'none'

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
    with evaluation_scope():   # batch-invariant work (a CLIP prompt's text features) once for the split
        out = [method.evaluator.predict(model, b).argmax(dim=1)
               for b in iterate_batches(split, indices, batch_size, pipeline)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=indices.device)


@torch.no_grad()
def predict_clients(method, model, plan: OnePassEval, stacked: dict[str, torch.Tensor], split: DeviceSplit,
                    indices: torch.Tensor, pipeline: InputPipeline, batch_size: int) -> list[torch.Tensor]:
    """Predicted labels for ``split`` at ``indices`` of each client whose tensors are stacked (client axis first) in
    ``stacked``: every batch scored by up to ``CLIENTS_PER_PASS`` clients' models in one pass."""
    k = len(next(iter(stacked.values())))
    out: list[list[torch.Tensor]] = [[] for _ in range(k)]
    predict = with_stacked(model, plan.predict)
    with evaluation_scope():   # batch-invariant work (CLIP prompts' text features) once per group of clients
        for b in iterate_batches(split, indices, batch_size, pipeline):
            for lo in range(0, k, CLIENTS_PER_PASS):
                rows = tuple(range(lo, min(k, lo + CLIENTS_PER_PASS)))
                owners = Owners(rows, (len(b.y),) * len(rows))
                batch = b if len(rows) == 1 else concat_batches([b] * len(rows))
                logits = predict(stacked, batch, owners)
                for r, part in zip(rows, owners.split(logits)):
                    out[r].append(part.argmax(dim=1))
    empty = torch.empty(0, dtype=torch.long, device=indices.device)
    return [torch.cat(p) if p else empty for p in out]


def _by_model(method, load: Callable[[int | None], torch.nn.Module], num_clients: int,
              alone: Callable[[int, torch.nn.Module], object],
              together: Callable[[torch.nn.Module, OnePassEval, list[int], dict[str, torch.Tensor]], list]) -> list:
    """Per client, ``alone(c, model)`` for a client scored by itself, or its item of ``together(model, plan, clients,
    stacked)`` for the clients of one model whose evaluator offers a one pass (their per-client tensors stacked,
    client axis first); each client's model is loaded in turn either way."""
    out: list = [None] * num_clients
    groups: dict[int, tuple[torch.nn.Module, OnePassEval, list[int], list[dict]]] = {}
    for c in range(num_clients):
        model = load(c)
        device = rules_device(next(iter(model.parameters())))
        plan = method.evaluator.one_pass(model) if one_pass_on(device) else None
        if plan is None:
            out[c] = alone(c, model)
            continue
        group = groups.setdefault(id(model), (model, plan, [], []))
        group[2].append(c)
        group[3].append(module_state(model, method.keys(c)))
    for model, plan, clients, snaps in groups.values():
        keys = list(snaps[0])
        names = keys if plan.per_client is None else [k for k in keys if k in set(plan.per_client)]
        check_alike(snaps, [k for k in keys if k not in names])
        stacked = {n: torch.stack([s[n] for s in snaps]) for n in names}
        for c, item in zip(clients, together(model, plan, clients, stacked), strict=True):
            out[c] = item
    return out


def _personal_predictions(method, sets: EvalSets, pipeline: InputPipeline, batch_size: int,
                          load: Callable[[int | None], torch.nn.Module], num_clients: int
                          ) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
    """Per client, its own model's predictions on the pooled local test set and (predictions, labels) on the global
    test set: one client at a time, or the clients of one model together where the evaluator offers a one pass (the
    same predictions)."""
    def alone(c: int, model: torch.nn.Module) -> tuple:
        pred = predict(method, model, sets.source, sets.pooled, pipeline, batch_size)
        return pred, _global_predictions(method, model, sets, pred, pipeline, batch_size)

    def together(model, plan: OnePassEval, clients: list[int], stacked: dict[str, torch.Tensor]) -> list:
        pooled = predict_clients(method, model, plan, stacked, sets.source, sets.pooled, pipeline, batch_size)
        if sets.global_test != "official_test":
            return [(p, _global_predictions(method, model, sets, p, pipeline, batch_size)) for p in pooled]
        idx = torch.arange(len(sets.official.y), device=sets.official.y.device)
        official = predict_clients(method, model, plan, stacked, sets.official, idx, pipeline, batch_size)
        return [(p, (o, sets.official.y)) for p, o in zip(pooled, official, strict=True)]

    return _by_model(method, load, num_clients, alone, together)


def _own_predictions(method, sets: EvalSets, pipeline: InputPipeline, batch_size: int,
                     load: Callable[[int | None], torch.nn.Module], num_clients: int) -> list[torch.Tensor]:
    """Per client, its own model's predictions on its own local test set only (``global_test`` none), in the order
    of its test indices: one client at a time, or the clients of one model in one pass over their own batches."""
    def alone(c: int, model: torch.nn.Module) -> torch.Tensor:
        return predict(method, model, sets.source, sets.client_indices[c], pipeline, batch_size)

    def together(model, plan: OnePassEval, clients: list[int], stacked: dict[str, torch.Tensor]) -> list:
        return predict_own_clients(method, model, plan, stacked, sets.source,
                                   [sets.client_indices[c] for c in clients], pipeline, batch_size)

    return _by_model(method, load, num_clients, alone, together)


@torch.no_grad()
def predict_own_clients(method, model, plan: OnePassEval, stacked: dict[str, torch.Tensor], split: DeviceSplit,
                        indices: list[torch.Tensor], pipeline: InputPipeline, batch_size: int) -> list[torch.Tensor]:
    """Predicted labels of each client whose tensors are stacked in ``stacked`` on its own ``indices`` of ``split``:
    the clients in groups of ``CLIENTS_PER_PASS``, each step of a group one pass over the next batch of every client
    of the group that has one, concatenated (each segment read through its own client's tensors; only one group's
    batches are alive at a time)."""
    out: list[list[torch.Tensor]] = [[] for _ in indices]
    predict = with_stacked(model, plan.predict)
    with evaluation_scope():
        for lo in range(0, len(indices), CLIENTS_PER_PASS):
            group = {r: iter(iterate_batches(split, indices[r], batch_size, pipeline))
                     for r in range(lo, min(len(indices), lo + CLIENTS_PER_PASS))}
            while step := [(r, b) for r, it in group.items() if (b := next(it, None)) is not None]:
                owners = Owners(tuple(r for r, _ in step), tuple(len(b.y) for _, b in step))
                batch = step[0][1] if len(step) == 1 else concat_batches([b for _, b in step])
                for r, seg in zip(owners.rows, owners.split(predict(stacked, batch, owners))):
                    out[r].append(seg.argmax(dim=1))
    empty = torch.empty(0, dtype=torch.long, device=split.y.device)
    return [torch.cat(p) if p else empty for p in out]


def _client_correct(pred_pooled: torch.Tensor, sets: EvalSets, client: int) -> tuple[int, int]:
    """(correct, total) of one client's local test set from pooled predictions."""
    pos = sets.positions(client)
    labels = sets.source.y[sets.pooled[pos]]
    return int((pred_pooled[pos] == labels).sum()), len(pos)


def _global_predictions(method, model, sets: EvalSets, pred_pooled: torch.Tensor, pipeline: InputPipeline,
                        batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictions, labels) of the loaded model on the global test set."""
    if sets.global_test == "official_test":
        idx = torch.arange(len(sets.official.y), device=sets.official.y.device)
        return predict(method, model, sets.official, idx, pipeline, batch_size), sets.official.y
    # pooled over the union of local test sets, each client's images counted as in its set (SGPT code)
    pos = [sets.positions(c) for c in range(len(sets.client_indices))]
    pos = torch.cat(pos) if pos else torch.empty(0, dtype=torch.long, device=pred_pooled.device)
    return pred_pooled[pos], sets.source.y[sets.pooled[pos]]


def _global_acc(sets: EvalSets, pred: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy on the global test set (official: a float32 mean; pooled: correct / total in integers)."""
    if sets.global_test == "official_test":
        return float((pred == labels).float().mean())
    return int((pred == labels).sum()) / max(len(labels), 1)


def class_accuracy(pred: torch.Tensor, labels: torch.Tensor, num_classes: int) -> list[float]:
    """Accuracy on each class's images (NaN for a class with none)."""
    total = torch.bincount(labels, minlength=num_classes).tolist()
    correct = torch.bincount(labels[pred == labels], minlength=num_classes).tolist()
    return [k / n if n else math.nan for k, n in zip(correct, total, strict=True)]


def _class_rows(client: int, accs: list[float]) -> list[tuple[int, str, str, float]]:
    """One ``acc_class<k>`` row per class."""
    return [(client, "global", f"acc_class{k}", a) for k, a in enumerate(accs)]


def evaluate_round(method, sets: EvalSets, pipeline: InputPipeline, batch_size: int,
                   load: Callable[[int | None], torch.nn.Module], per_class: bool = False,
                   untrained: frozenset[int] = frozenset(),
                   exclude_untrained: bool = False) -> list[tuple[int, str, str, float]]:
    """Rows (client, split, metric, value) for one evaluated round; ``load(cid)`` loads and returns the model
    that scores client ``cid`` (``load(None)``: the global model); ``per_class`` adds ``acc_class<k>`` rows.

    Personalised models only: ``untrained`` are the clients never sampled so far (scored with their initial
    model, e.g. a random head); their number is logged as ``untrained_clients``, and with ``exclude_untrained``
    the round's aggregates (client -1) leave them out (their own rows stay)."""
    rows: list[tuple[int, str, str, float]] = []
    num_clients = len(sets.client_indices)
    local_acc: list[float] = []
    counted = [c for c in range(num_clients) if not (exclude_untrained and c in untrained)] or list(range(num_clients))
    own_only = sets.global_test == "none"
    if own_only and per_class:
        raise ValueError("evaluation.per_class reads the global test set, and global_test is none")
    global_acc = None
    if not method.evaluator.personalized:
        model = load(None)
        pred = predict(method, model, sets.source, sets.pooled, pipeline, batch_size)
        for c in range(num_clients):
            k, n = _client_correct(pred, sets, c)
            local_acc.append(k / max(n, 1))
        if not own_only:
            g_pred, g_labels = _global_predictions(method, model, sets, pred, pipeline, batch_size)
            global_acc = _global_acc(sets, g_pred, g_labels)
            if per_class:
                rows += _class_rows(-1, class_accuracy(g_pred, g_labels, method.num_classes))
    elif own_only:
        # each client's own model on its own test set only
        for c, pred in enumerate(_own_predictions(method, sets, pipeline, batch_size, load, num_clients)):
            labels = sets.source.y[sets.client_indices[c]]
            local_acc.append(int((pred == labels).sum()) / max(len(labels), 1))
        rows.append((-1, "local", "untrained_clients", float(len(untrained))))
    else:
        # each client's own model: local accuracy on its test set, global accuracy on the global test set
        global_accs, class_accs = [], []
        for c, (pred, (g_pred, g_labels)) in enumerate(_personal_predictions(method, sets, pipeline, batch_size, load,
                                                                            num_clients)):
            k, n = _client_correct(pred, sets, c)
            local_acc.append(k / max(n, 1))
            global_accs.append(_global_acc(sets, g_pred, g_labels))
            rows.append((c, "global", "acc", global_accs[-1]))
            if per_class:
                class_accs.append(class_accuracy(g_pred, g_labels, method.num_classes))
                rows += _class_rows(c, class_accs[-1])
        kept = [global_accs[c] for c in counted]
        global_acc = sum(kept) / len(kept)
        # the lowest and highest client on the global test set (FedHPL Tables 3, 14)
        rows += [(-1, "global", "acc_min", min(kept)), (-1, "global", "acc_max", max(kept))]
        if per_class:
            rows += _class_rows(-1, [sum(a[c] for c in counted) / len(counted)
                                     for a in zip(*class_accs, strict=True)])
        rows.append((-1, "local", "untrained_clients", float(len(untrained))))
    for c, a in enumerate(local_acc):
        rows.append((c, "local", "acc", a))
    local_kept = [local_acc[c] for c in counted] if method.evaluator.personalized else local_acc
    if global_acc is not None:
        rows.append((-1, "global", "acc", global_acc))
    rows.append((-1, "local", "acc_mean", sum(local_kept) / len(local_kept)))
    rows.append((-1, "local", "acc_worst", min(local_kept)))
    return rows
