"""Local optimisation shared by every client: the experiment's optimiser, autocast, the epoch loop."""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from fedcore.engine.data import Batch, InputPipeline
from fedcore.engine.precision import autocast_for

__all__ = ["TrainSettings", "ClientData", "OptimizerSpec", "autocast_for", "optimizer_spec", "make_optimizer",
           "run_epochs", "epoch_stream", "only_training"]


@dataclass
class TrainSettings:
    """The budget and optimiser of a local update (from the experiment's federation/optimizer)."""

    local_epochs: int
    batch_size: int
    optimizer: dict = field(default_factory=dict)
    #: ``torch.compile`` mode of the one-pass step (fedcore/engine/onepass.py; "reduce-overhead": CUDA graphs), None:
    #: eager; the engine sets it from ``RunSpec.compile`` on CUDA only
    compile: str | None = None


@dataclass
class ClientData:
    """One client's training data in one round, as the engine hands it to the client role."""

    cid: int
    num_samples: int
    batches: Callable[[], Iterator[Batch]]  # a fresh, seeded pass over the client's data (one epoch) per call
    generator: torch.Generator              # for any other randomness of this client in this round
    settings: TrainSettings | None = None   # the experiment's budget and optimiser (a client that trains at
                                            # evaluation time reads it; None where no experiment is at hand)
    # the run's augmentation ``name`` of a model-ready batch, drawing from ``generator`` (views a method makes
    # itself, e.g. FedPFT's two MoCo views; fedcore.engine.data.InputPipeline.augment); None outside a run
    augment: Callable[[Tensor, str], Tensor] | None = None
    # the experiment's base augmentation (names, in order) that the client applies itself to the batches it gets
    # (``Client.train_augment``; FedPFT: to its CE view, not to the images its MoCo views are made from)
    base_augment: tuple[str, ...] = ()
    # the run's input pipeline behind ``augment`` (which draws from ``generator``): its draw/apply split lets clients
    # trained together make their views in one batched call; None outside a run
    pipeline: InputPipeline | None = None
    # a pass over the client's images in order, without the training augmentation (what an evaluation-time score
    # of the client's data reads, e.g. pFedGate's client-level gate); None outside a run
    plain: Callable[[], Iterator[Batch]] | None = None

    def plain_batches(self) -> Iterator[Batch]:
        """Every image of the client once, in order, not augmented (``plain``); outside a run (``plain`` None), the
        training batches."""
        return (self.plain or self.batches)()


@dataclass(frozen=True)
class OptimizerSpec:
    """The experiment's optimiser, read once from its ``optimizer`` block (other keys ignored): what every client
    optimiser is built from, torch's (``make_optimizer``) and the functional one of clients trained together."""

    name: str
    lr: float
    momentum: float = 0.0          # SGD only
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # Adam/AdamW: torch's defaults, which the config does not set
    eps: float = 1e-8


OPTIMIZERS = ("sgd", "adam", "adamw")


def optimizer_spec(cfg: dict | OptimizerSpec) -> OptimizerSpec:
    """The validated optimiser of an ``optimizer`` block (the one place its defaults live)."""
    if isinstance(cfg, OptimizerSpec):
        return cfg
    name = cfg.get("name", "sgd")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name must be sgd|adam|adamw, got {name!r}")
    return OptimizerSpec(name, float(cfg.get("lr", 0.01)), float(cfg.get("momentum", 0.0)) if name == "sgd" else 0.0,
                         float(cfg.get("weight_decay", 0.0)))


def make_optimizer(params: list[nn.Parameter] | list[dict], cfg: dict | OptimizerSpec) -> torch.optim.Optimizer:
    """The experiment's torch optimiser over ``params`` (tensors, or parameter groups with their own ``lr``)."""
    spec = optimizer_spec(cfg)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


def run_epochs(params: list[nn.Parameter], data: ClientData, settings: TrainSettings, epochs: int,
               loss_fn: Callable[[Batch], Tensor], optimizer_state: dict | None = None,
               ) -> tuple[dict[str, float], dict[str, Any]]:
    """Minibatch training of ``params``; returns stats (mean loss) and the optimiser's final state.

    A fresh optimiser unless ``optimizer_state`` is given (a client that keeps its optimiser across rounds).
    """
    opt = make_optimizer(params, settings.optimizer)
    if optimizer_state:
        opt.load_state_dict(optimizer_state)
    total, count = None, 0  # the loss sum stays on the device: no GPU sync per step
    for _ in range(epochs):
        for batch in data.batches():
            opt.zero_grad(set_to_none=True)
            with autocast_for(batch.x):
                loss = loss_fn(batch)
            loss.backward()
            opt.step()
            step = loss.detach().double() * len(batch.y)
            total = step if total is None else total + step
            count += len(batch.y)
    return {"loss": float(total) / count if count else float("nan")}, opt.state_dict()


def epoch_stream(data: ClientData, epochs: int) -> Iterator[Batch]:
    """A client's batches over all its local epochs, drawn lazily as in the one-by-one loop."""
    return itertools.chain.from_iterable(data.batches() for _ in range(epochs))


@contextlib.contextmanager
def only_training(model: nn.Module, keys: list[str]) -> Iterator[list[nn.Parameter]]:
    """Within the block only the named parameters require grad, so no gradient is even computed for the others;
    yields them in ``keys`` order and restores every flag afterwards."""
    named = dict(model.named_parameters())
    before = {n: p.requires_grad for n, p in named.items()}
    try:
        for n, p in named.items():
            p.requires_grad_(n in keys and before[n])
        yield [named[k] for k in keys]
    finally:
        for n, p in named.items():
            p.requires_grad_(before[n])
