"""The generic ways a round's clients train together, built from what a client declares (``Client.together``).

A client whose update is the default one (``local_epochs`` epochs of its ``loss`` over its model's trainable
tensors, a fresh optimiser, nothing random in the loss) answers ``Client.together`` with :func:`epochs_of_loss`;
a client with its own update builds its own :class:`~fedcore.engine.roles.Together` (FedPFT's vmapped phases).
Whatever the path, each client sees the batches, loss and optimiser arithmetic of its one-by-one update.

Paths: ``one pass`` (fedcore/engine/onepass.py: the clients' batches concatenated, one forward and backward of
the frozen backbone per step, each sample reading its own client's rows of the stacked per-client tensors; for a
client that declares its per-client tensors and losses, :class:`OnePass`), and ``vmap`` (fedcore/engine/together.py:
one ``torch.func.vmap`` over the clients' stacked copies of the module per step; any module, BatchNorm included; on
CUDA not for attention models, whose vmapped backward fails there). Where a client offers both, ``ONE_PASS_ON``
(chosen by measurement, benchmarks/bench_onepass.py) says on which device types the one pass is taken.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import Tensor, nn

from fedcore.engine.onepass import AfterStep, ClientLosses, train_one_pass
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for, epoch_stream
from fedcore.engine.roles import FitResult, FitTogether, Payload, Together, load_state, module_state
from fedcore.engine.together import has_attention, train_together

if TYPE_CHECKING:
    from fedcore.engine.roles import Client

#: why the vmapped path is not taken for attention models on CUDA (measured, fedcore/engine/together.py, Limits)
ATTENTION_ON_CUDA = "attention on CUDA: one client at a time is faster there (fedcore/engine/together.py, Limits)"
#: device types where a client that offers a one pass trains its round's clients that way (benchmarks/bench_onepass.py:
#: CUDA, where vmap over attention fails; the CPU, where it matches one by one bit for bit and is faster than both)
ONE_PASS_ON: frozenset[str] = frozenset({"cuda", "cpu"})
#: at most this many samples a step in one pass: a round of more clients (Local's 100 on CIFAR-100) trains as several
#: passes of ``PASS_SAMPLES // batch_size`` clients each (the same numbers: clients never meet in a pass)
PASS_SAMPLES = 512


@dataclass(frozen=True)
class OnePass:
    """What a client declares to train a round's clients in one pass through the frozen backbone: each active
    client's loss of a concatenated batch (``losses``, fedcore/engine/onepass.py), the model's tensors that differ
    per client (``per_client``: state keys, stacked on a client axis; None: every state key; the others must be
    alike for every client, e.g. token ids), and an optional correction after each optimiser step, built from the
    round's downlinks (FedPR's projection)."""

    losses: ClientLosses
    per_client: Sequence[str] | None = None
    after_step: Callable[[list[Payload]], AfterStep] | None = None


@dataclass(frozen=True)
class OnePassEval:
    """What an evaluator declares to score every client's own model in one pass: the logits of a concatenated batch
    whose segments belong to the clients of ``Owners`` (``predict``), and the tensors that differ per client (as
    :class:`OnePass`)."""

    predict: ClientLosses
    per_client: Sequence[str] | None = None


def one_pass_on(device: str) -> bool:
    """Whether the one pass is the together path on a ``device`` type (``ONE_PASS_ON``)."""
    return device in ONE_PASS_ON


def in_passes(fit: FitTogether) -> FitTogether:
    """``fit`` over the round's clients in groups of at most ``PASS_SAMPLES // batch_size`` (one pass each)."""
    def run(states: list[Payload], downlinks: list[Payload], datas: list[ClientData],
            settings: TrainSettings) -> list[tuple[Payload, FitResult]]:
        per = max(1, PASS_SAMPLES // max(1, settings.batch_size))
        out: list[tuple[Payload, FitResult]] = []
        for i in range(0, len(datas), per):
            out += fit(states[i:i + per], downlinks[i:i + per], datas[i:i + per], settings)
        return out
    return run


def epochs_of_loss(client: "Client", device: str, model: nn.Module, *, one_pass: OnePass | None = None,
                   vmap: bool = True, epochs: int | None = None) -> Together:
    """The together path of a client whose update is ``epochs`` (None: the experiment's ``local_epochs``) epochs of
    its ``loss`` with nothing random in it, a fresh optimiser or its kept one, on ``model`` and a ``device`` type:
    the one pass where the client offers one (``one_pass``) and it is chosen there, else the vmapped path where the
    client allows it (``vmap``) and it can run."""
    if not any(p.requires_grad for p in model.parameters()):
        return Together.no("nothing to train")  # one by one makes no pass over the data (Client.train)
    if one_pass is not None and one_pass_on(device):
        return Together(in_passes(lambda states, downlinks, datas, settings: one_pass_epochs(
            client, one_pass, states, downlinks, datas, settings, epochs)), how="one pass through the frozen backbone",
            exact=device == "cpu")
    if not vmap:
        return Together.no(f"{type(client).__name__} trains together in one pass only, not taken on the "
                           f"{device.upper()}" if one_pass is not None else
                           f"{type(client).__name__} offers no one pass for {type(model).__name__}")
    if client.keep_optimizer:
        return Together.no("the client keeps its optimiser across rounds")
    if device == "cuda" and has_attention(model):
        return Together.no(ATTENTION_ON_CUDA)
    return Together(lambda states, downlinks, datas, settings: vmapped_epochs(client, states, downlinks, datas,
                                                                             settings, epochs),
                    how="one vectorised pass per step (vmap)")


def start_states(client: "Client", model: nn.Module, keys: list[str], states: list[Payload],
                 downlinks: list[Payload], datas: list[ClientData]) -> list[dict[str, Tensor]]:
    """Each client's tensors as its round starts (``Client.start`` with its state and downlink)."""
    starts = []
    for st, down, d in zip(states, downlinks, datas, strict=True):
        client.start(model, d.cid, st, down)
        starts.append(module_state(model, keys))
    return starts


def check_alike(starts: list[dict[str, Tensor]], keys: Sequence[str]) -> None:
    """The tensors one pass keeps unstacked must be the same for every client."""
    for k in keys:
        if any(not torch.equal(s[k], starts[0][k]) for s in starts[1:]):
            raise ValueError(f"{k} differs between the clients trained in one pass but is not declared per client")


def one_pass_epochs(client: "Client", declared: OnePass, states: list[Payload], downlinks: list[Payload],
                    datas: list[ClientData], settings: TrainSettings,
                    epochs: int | None = None) -> list[tuple[Payload, FitResult]]:
    """The round's clients (one model) in one pass per step, each equal to its ``fit`` (``start``, epochs of
    ``loss`` with a fresh or its kept optimiser and ``after_step``, ``finish``) up to float reassociation in the
    frozen backbone's kernels (none on the CPU)."""
    method = client.method
    cid0 = datas[0].cid
    model = method.model_for(cid0).train()
    keys, trainable = method.keys(cid0), method.trainable_keys(cid0)
    per_client = keys if declared.per_client is None else [k for k in keys if k in set(declared.per_client)]
    starts = start_states(client, model, keys, states, downlinks, datas)
    check_alike(starts, [k for k in keys if k not in per_client])
    n = settings.local_epochs if epochs is None else int(epochs)
    streams = [epoch_stream(d, n) for d in datas]
    keep = bool(client.keep_optimizer)
    kept = [st.get("optimizer") for st in states] if keep else None
    after = declared.after_step(downlinks) if declared.after_step is not None else None
    fitted = train_one_pass(model, per_client, trainable, starts, streams, declared.losses, settings.optimizer,
                            kept=kept, keep_optimizer=keep, after_step=after, compile_mode=settings.compile)
    out = []
    for st, d, f in zip(states, datas, fitted, strict=True):
        load_state(model, f.state)
        out.append(client.finish(model, d.cid, st, d, {"loss": f.loss}, f.optimizer))
    return out


def vmapped_epochs(client: "Client", states: list[Payload], downlinks: list[Payload], datas: list[ClientData],
                   settings: TrainSettings, epochs: int | None = None) -> list[tuple[Payload, FitResult]]:
    """The round's clients (one model) in one vmapped pass per step, each equal to its ``fit`` up to float
    reassociation: ``start``, epochs of ``loss`` (fedcore/engine/together.py's ``train_together``), ``finish``."""
    method = client.method
    cid0 = datas[0].cid
    model = method.model_for(cid0).train()
    keys, trainable = method.keys(cid0), method.trainable_keys(cid0)
    starts = start_states(client, model, keys, states, downlinks, datas)
    n = settings.local_epochs if epochs is None else int(epochs)
    streams = [epoch_stream(d, n) for d in datas]
    with autocast_for(next(iter(model.parameters()))):
        finals = train_together(model, keys, trainable, starts, streams, client.loss, settings.optimizer)
    out = []
    for st, d, (final, loss) in zip(states, datas, finals, strict=True):
        load_state(model, final)
        out.append(client.finish(model, d.cid, st, d, {"loss": loss}, None))
    return out
