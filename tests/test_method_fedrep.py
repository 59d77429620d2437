"""FedRep: head phase then body phase, each freezing the other part; personal heads; end-to-end runs."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from conftest import identity, run_params
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import build_vit
from fedcore.methods import method_class
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, load_state, module_state
from fedcore.train import train_run

HEAD, BODY = ["head.weight", "head.bias"], ["prompts.0"]
SETTINGS = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}


def _method(**params):
    torch.manual_seed(0)
    return method_class("fedrep")(PromptedViT(build_vit("vit_mini")), 4, params)


def _client(cid: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(cid)
    batches = [Batch(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g),
                     torch.arange(8 * i, 8 * i + 8), {}) for i in range(2)]
    return ClientData(cid, 16, lambda: iter(batches), torch.Generator())


def _requires_grad(method) -> list[str]:
    return [n for n, p in method.model.named_parameters() if p.requires_grad]


def _changed(before: dict, after: dict) -> set[str]:
    return {n for n in before if not torch.equal(before[n], after[n])}


def test_head_phase_freezes_prompts_and_body_phase_freezes_head():
    method = _method()
    load_state(method.model, {"head.weight": 0.1 * torch.randn(4, 64)})  # a nonzero head: prompts get a gradient
    names = method.trainable_keys(0)
    assert _requires_grad(method) == names
    keys = method.keys(0)
    assert method.client.shared_keys(keys) == BODY and method.client.personal_keys(keys) == HEAD

    before = module_state(method.model, names)
    method.client.train_phase(method.model, HEAD, _client(), TrainSettings(2, 8, SETTINGS), 2)
    mid = module_state(method.model, names)
    assert _changed(before, mid) == set(HEAD)
    assert method.model.prompts[0].grad is None  # no gradient was even computed for the frozen prompts

    method.client.train_phase(method.model, BODY, _client(), TrainSettings(2, 8, SETTINGS), 2)
    after = module_state(method.model, names)
    assert _changed(mid, after) == set(BODY)
    assert _requires_grad(method) == names  # the phases restore requires_grad


def test_local_update_runs_head_epochs_then_body_epochs_within_the_budget(monkeypatch):
    method = _method()
    client = method.client
    assert client.epochs(5) == (4, 1) and client.epochs(2) == (1, 1) and client.epochs(1) == (1, 1)
    assert _method(head_epochs=3, body_epochs=2).client.epochs(5) == (3, 2)
    calls = []
    monkeypatch.setattr(client, "train_phase", lambda model, names, data, settings, epochs:
                        calls.append((names, epochs)) or {"loss": float(epochs)})
    downlink = method.strategy.configure(method.strategy.init_state(1), 0)
    _, result = client.fit(0, client.init_state(0), downlink, _client(), TrainSettings(5, 8, SETTINGS))
    stats = result.stats
    assert calls == [(HEAD, 4), (BODY, 1)]
    assert stats["loss"] == pytest.approx((4 * 4 + 1 * 1) / 5)  # epoch-weighted mean of the two phases


def test_upload_and_aggregate_average_prompts_only():
    method = _method()
    results = []
    for cid, (value, n) in enumerate(((1.0, 1), (4.0, 3))):
        load_state(method.model, {"prompts.0": torch.full((1, 64), value), "head.weight": torch.full((4, 64), value)})
        results.append(FitResult(cid, n, method.client.upload(method.model, cid, _client(cid), {}), {}))
    assert all(set(r.uplink) == {"model"} and set(r.uplink["model"]) == set(BODY) for r in results)  # heads stay
    server = {**method.strategy.init_state(2), "model": {"prompts.0": torch.zeros(1, 64)}}
    glob = method.strategy.aggregate(RoundInfo(1, 2, 1.0, 0), server, results)["model"]
    assert set(glob) == set(BODY) and torch.allclose(glob["prompts.0"], torch.full((1, 64), 3.25))


# ---- end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_files(learnable_run_files):
    return learnable_run_files


def _train(files, work):
    work.mkdir()
    params = run_params(rounds=3, participation=1.0, local_epochs=2)
    params["optimizer"]["lr"] = 0.01
    return train_run(params, identity("fedrep"), files["dataset"], files["partition"], "vit_mini",
                     files["weights"], work / "m.parquet", work / "f.pt", progress=False)


def test_end_to_end_learns_and_is_deterministic(trained_files, tmp_path):
    a = _train(trained_files, tmp_path / "a")
    b = _train(trained_files, tmp_path / "b")
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    m = a.metrics
    assert all(math.isfinite(v) for v in m["value"])
    last = m[(m.client == -1) & (m["round"] >= 2)]
    assert last[last.metric == "acc_mean"]["value"].mean() > 0.5  # 4 classes: chance is 0.25
    assert last[(last.split == "global") & (last.metric == "acc")]["value"].mean() > 0.5
    assert set(a.global_state) == set(BODY)  # the server holds the representation only
    heads = torch.stack([a.personal_states[c]["head.weight"] for c in range(4)])
    assert (heads - heads.mean(0)).abs().amax(dim=(1, 2)).min() > 1e-4  # personal, not averaged

