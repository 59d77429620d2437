"""The engine's boundary: every state and payload a role hands over ends on the run's device."""
from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from fedcore.engine.placement import Boundary, check_model_device, off_device, place
from virtual_device import VIRTUAL, OnVirtualDevice

Pair = namedtuple("Pair", "a b")


def test_place_moves_every_nested_tensor_and_keeps_the_rest():
    payload = {"model": {"w": torch.ones(2)}, "list": [torch.zeros(1), 3, "x"], "pair": Pair(torch.ones(1), None),
               "t": (torch.ones(1), 2.0), "n": None}
    with OnVirtualDevice():
        moved = place(payload, VIRTUAL)
        assert off_device(moved, VIRTUAL) == []
    assert isinstance(moved["pair"], Pair) and moved["list"][1:] == [3, "x"] and moved["t"][1] == 2.0
    assert sorted(off_device(payload, VIRTUAL)) == ["list[0] on cpu", "model.w on cpu", "pair[0] on cpu", "t[0] on cpu"]


def test_a_model_off_the_runs_device_is_refused_naming_the_tensor():
    model = torch.nn.Linear(2, 2)
    check_model_device([model], torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"model 0: weight is on cpu.*Method.to"):
        check_model_device([model], torch.device("meta"))


def test_method_to_moves_the_initial_state_the_server_starts_from(tiny_run_files):
    from fedcore.backbones.registry import build_backbone, prompt_adapter
    from fedcore.methods import method_class

    method = method_class("sgpt")(prompt_adapter(build_backbone("vit_mini", tiny_run_files["weights"])), 4,
                                  {"groups": 2, "shared_blocks": [0, 1], "group_blocks": [2, 3], "select_block": 1})
    with OnVirtualDevice():
        method.to(VIRTUAL)
        bare = method.strategy.init_state(3)
        assert off_device(bare["model"], VIRTUAL) == []  # the model's tensors as built, now on the device
        assert off_device(bare, VIRTUAL) == ["v on cpu"]  # SGPT's own counter is made on the CPU...
        assert off_device(Boundary(method, VIRTUAL).server_init(3), VIRTUAL) == []  # ...and the boundary moves it
