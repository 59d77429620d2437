"""Train a round's sampled clients together: one forward of the frozen backbone over all their batches.

Each client's prompts and head are stacked on a leading client axis; sample i uses client owner[i]'s
tensors (per-sample prompts). The loss is the sum over clients of each client's mean cross-entropy, so
every client's gradient is exactly the gradient of its own batch. The SGD step is applied only to clients
that had a batch at this step (clients with fewer batches finish early), reproducing torch.optim.SGD's
arithmetic per client. The result equals training the clients one by one up to floating-point
reassociation in the larger matrix products (tests/test_engine.py checks it).
"""
from __future__ import annotations

import itertools
from typing import Iterator

import torch
from torch.nn import functional as F

from fedcore.methods.base import ClientData, Method, TrainSettings, autocast_for


def can_batch(method: Method, settings: TrainSettings, num_clients: int) -> bool:
    """Whether this round may use the batched path (SGD only: it is re-implemented here, masked per client)."""
    return method.batched_clients and num_clients > 1 and settings.optimizer.get("name", "sgd") == "sgd"


def _epochs(data: ClientData, epochs: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A client's batches over all its local epochs, drawn lazily as in the one-by-one loop."""
    return itertools.chain.from_iterable(data.batches() for _ in range(epochs))


@torch.no_grad()
def _masked_sgd(params: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor], active: torch.Tensor,
                cfg: dict) -> None:
    """torch.optim.SGD (dampening 0, no Nesterov) applied only to the clients in ``active``."""
    lr, momentum, wd = cfg.get("lr", 0.01), cfg.get("momentum", 0.0), cfg.get("weight_decay", 0.0)
    for name, p in params.items():
        mask = active.view(-1, *([1] * (p.dim() - 1)))
        d_p = p.grad if not wd else p.grad.add(p, alpha=wd)
        if momentum:
            buf = bufs.get(name)
            # every client is active at the first step, where torch sets buf = d_p
            new = d_p.clone() if buf is None else buf.mul(momentum).add(d_p)
            bufs[name] = new if buf is None else torch.where(mask, new, buf)
            d_p = bufs[name]
        p.add_(torch.where(mask, d_p, 0.0), alpha=-lr)
        p.grad = None


def train_together(method: Method, starts: list[dict[str, torch.Tensor]], datas: list[ClientData],
                   settings: TrainSettings) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """Each client's final trainable tensors and stats, trained from ``starts`` on its own data."""
    k = len(datas)
    names = method.trainable_names()
    params = {n: torch.stack([s[n] for s in starts]).detach().clone().requires_grad_(True) for n in names}
    bufs: dict[str, torch.Tensor] = {}
    streams = [_epochs(d, settings.local_epochs) for d in datas]
    # loss sums stay on the device: reading them every step would sync the GPU once per step
    loss_sum = seen = None
    while True:
        xs, ys, owners, active = [], [], [], []
        for c, stream in enumerate(streams):
            batch = next(stream, None)
            if batch is not None:
                xs.append(batch[0]), ys.append(batch[1]), active.append(c)
                owners.append(torch.full((len(batch[1]),), c, dtype=torch.long, device=batch[1].device))
        if not active:
            break
        x, y, owner = torch.cat(xs), torch.cat(ys), torch.cat(owners)
        with autocast_for(x):
            logits = method.model.forward_owned(x, params, owner)
        ce = F.cross_entropy(logits.float(), y, reduction="none")
        n = torch.zeros(k, device=ce.device).index_add_(0, owner, torch.ones_like(ce))
        per_client = torch.zeros(k, device=ce.device).index_add_(0, owner, ce) / n.clamp(min=1)
        per_client.sum().backward()
        mask = torch.zeros(k, dtype=torch.bool, device=ce.device)
        mask[active] = True
        _masked_sgd(params, bufs, mask, settings.optimizer)
        step_sum, step_n = (per_client.detach() * n).double(), n.double()
        loss_sum = step_sum if loss_sum is None else loss_sum + step_sum
        seen = step_n if seen is None else seen + step_n
    mean_loss = (loss_sum / seen.clamp(min=1)).tolist() if loss_sum is not None else [float("nan")] * k
    return [({n: params[n][c].detach().clone() for n in names}, {"loss": mean_loss[c]}) for c in range(k)]
