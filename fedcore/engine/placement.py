"""Where a run's tensors live: on its device, whatever a method's roles hand the engine.

The engine calls a method's roles only through :class:`Boundary`: every server state, client state, downlink and
uplink that crosses it is moved to the run's device, so a role can never leave state behind on the CPU (two
CUDA-only crashes came from exactly that: a server state built before the model moved to the GPU, combined with
uploads made on it). Moving is a no-op for a tensor already there. :func:`off_device` lists what is not.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from fedcore.engine.optim import ClientData, TrainSettings
    from fedcore.engine.roles import FitResult, Method, Payload, RoundInfo


def place(payload: Any, device: torch.device) -> Any:
    """``payload`` with every tensor moved to ``device``, through nested dicts, lists and tuples."""
    if isinstance(payload, torch.Tensor):
        return payload.to(device)
    if isinstance(payload, dict):
        return {k: place(v, device) for k, v in payload.items()}
    if isinstance(payload, list):
        return [place(v, device) for v in payload]
    if isinstance(payload, tuple):
        return type(payload)(*(place(v, device) for v in payload)) if hasattr(payload, "_fields") \
            else tuple(place(v, device) for v in payload)
    return payload


def off_device(payload: Any, device: torch.device, path: str = "") -> list[str]:
    """The paths (``a.b[2]``) of the tensors in ``payload`` that are not on ``device``."""
    if isinstance(payload, torch.Tensor):
        return [] if payload.device == device else [f"{path or '<tensor>'} on {payload.device}"]
    if isinstance(payload, dict):
        return [p for k, v in payload.items() for p in off_device(v, device, f"{path}.{k}" if path else str(k))]
    if isinstance(payload, (list, tuple)):
        return [p for i, v in enumerate(payload) for p in off_device(v, device, f"{path}[{i}]")]
    return []


def check_model_device(models: Iterable[torch.nn.Module], device: torch.device) -> None:
    """Raise naming the tensor when a model holds a parameter or buffer off the run's device."""
    for i, model in enumerate(models):
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.device != device:
                raise RuntimeError(f"model {i}: {name} is on {t.device}, the run's data on {device}: move the method's "
                                   "models with Method.to(device) before the run")


class Boundary:
    """The engine's door to a method's roles: each call's states and payloads come out on ``device``."""

    def __init__(self, method: "Method", device: torch.device | str) -> None:
        self.method = method
        self.device = torch.device(device)

    def place(self, payload: Any) -> Any:
        """``payload`` on the run's device."""
        return place(payload, self.device)

    # ---- server side -----------------------------------------------------------------------------
    def server_init(self, num_clients: int) -> "Payload":
        """The strategy's state before round 1."""
        return self.place(self.method.strategy.init_state(num_clients))

    def server_setup(self, state: "Payload", uplinks: list["FitResult"]) -> "Payload":
        """The once-per-run exchange (the strategy updates ``state`` in place)."""
        self.method.strategy.setup(state, [self._result(r) for r in uplinks])
        return self.place(state)

    def select(self, info: "RoundInfo", state: "Payload") -> tuple[list[int], "Payload"]:
        """The round's clients, and the server state after choosing them (a strategy may note the round's draw in
        it: FedMD's public subset)."""
        selected = self.method.strategy.select(info, state)
        return selected, self.place(state)

    def downlink(self, state: "Payload", cid: int) -> "Payload":
        """Client ``cid``'s downlink."""
        return self.place(self.method.strategy.configure(state, cid))

    def observe(self, info: "RoundInfo", state: "Payload", result: "FitResult") -> "Payload":
        """The server state after one client's result."""
        return self.place(self.method.strategy.observe(info, state, result))

    def aggregate(self, info: "RoundInfo", state: "Payload", results: list["FitResult"]) -> "Payload":
        """The next server state from the round's results."""
        return self.place(self.method.strategy.aggregate(info, state, results))

    # ---- client side -----------------------------------------------------------------------------
    def client_init(self, cid: int) -> "Payload":
        """A client's state before it ever trains."""
        return self.place(self.method.client.init_state(cid))

    def client_setup(self, cid: int, data: "ClientData") -> "Payload | None":
        """A client's once-per-run uplink (None: nothing to send)."""
        return self.place(self.method.client.setup(cid, data))

    def fit(self, cid: int, state: "Payload", downlink: "Payload", data: "ClientData",
            settings: "TrainSettings") -> tuple["Payload", "FitResult"]:
        """One client's round on its own: its new state and result."""
        new_state, result = self.method.client.fit(cid, state, downlink, data, settings)
        return self.place(new_state), self._result(result)

    def fit_together(self, states: list["Payload"], downlinks: list["Payload"], datas: list["ClientData"],
                     settings: "TrainSettings") -> list[tuple["Payload", "FitResult"]]:
        """The round's clients trained together: each one's new state and result."""
        return [(self.place(s), self._result(r))
                for s, r in self.method.client.fit_together(states, downlinks, datas, settings)]

    def _result(self, result: "FitResult") -> "FitResult":
        return replace(result, uplink=self.place(result.uplink))
