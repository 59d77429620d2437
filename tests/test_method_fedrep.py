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



# ---- representation: backbone (FedHPL's Table 1 FedRep) ---------------------------------------------
def _backbone_method(**params):
    from fedcore.backbones.registry import build_backbone, prompt_adapter

    torch.manual_seed(0)
    return method_class("fedrep")(prompt_adapter(build_backbone("resnet_mini_18")), 4,
                                  {"representation": "backbone", "init": "random", **params})


def test_backbone_representation_shares_everything_but_the_head_and_trains_it_in_phases():
    method = _backbone_method()
    keys, client = method.keys(0), method.client
    assert client.personal_keys(keys) == HEAD and client.shared_keys(keys) == [k for k in keys if k not in HEAD]
    assert "net.bn1.running_mean" in client.shared_keys(keys) and "net.conv1.weight" in client.shared_keys(keys)
    calls = []
    original = client.train_phase
    client.train_phase = lambda model, names, data, settings, epochs: calls.append(list(names)) or original(
        model, names, data, settings, epochs)
    before = module_state(method.model.train(), keys)                   # the engine trains in train mode
    client.fit(0, client.init_state(0), method.strategy.configure(method.strategy.init_state(1), 0), _client(),
               TrainSettings(2, 8, SETTINGS))
    after = module_state(method.model, keys)
    params = method.trainable_keys(0)
    assert calls == [HEAD, [k for k in params if k not in HEAD]]       # head phase, then every body parameter
    assert _changed(before, after) >= set(HEAD) | {"net.conv1.weight", "net.bn1.running_mean"}


def test_backbone_representation_runs_two_rounds_with_personal_heads_and_resumes(hetero_files, tmp_path,
                                                                                 monkeypatch):
    from conftest import whole_run
    from fedcore.engine.roles import Strategy

    uplinks = []
    original = Strategy.aggregate
    monkeypatch.setattr(Strategy, "aggregate", lambda self, info, state, results: uplinks.extend(
        r.uplink["model"] for r in results) or original(self, info, state, results))
    params = {"representation": "backbone", "init": "random", "head_epochs": 2}
    full = whole_run(hetero_files, tmp_path / "full", "fedrep", "resnet_mini_18", **params)
    assert len(uplinks) == 10 and all(not set(u) & set(HEAD) and "net.bn1.running_var" in u for u in uplinks)
    assert not set(full.global_state) & set(HEAD)
    assert all(sorted(full.personal_states[c]) == sorted(HEAD) for c in range(5))
    m = full.metrics
    assert all(math.isfinite(v) for v in m["value"]) and m[m.metric.str.startswith("acc")]["value"].between(0, 1).all()
    last = m[m["round"] == 2]
    assert sorted(last[(last.split == "global") & (last.metric == "acc") & (last.client >= 0)].client) == list(range(5))
    assert whole_run(hetero_files, tmp_path / "cut", "fedrep", "resnet_mini_18", stop=1, **params) is None
    resumed = whole_run(hetero_files, tmp_path / "cut", "fedrep", "resnet_mini_18", **params)
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)


@pytest.mark.parametrize("params", [{"init": "random"}, {"common_dim": 32}])
def test_init_and_common_dim_are_refused_with_prompts(params):
    with pytest.raises(ValueError, match="representation: backbone only"):
        method_class("fedrep").check_params({**method_class("fedrep").defaults, **params})


def test_paper_scale_vit_b_backbone_representation():
    from fedcore.backbones.registry import build_backbone, prompt_adapter

    with torch.device("meta"):
        method = method_class("fedrep")(prompt_adapter(build_backbone("vit_base_patch16_224")), 10,
                                        {"representation": "backbone"})
    trainable = sum(p.numel() for p in method.model.parameters() if p.requires_grad)
    sent = sum(t.numel() for t in method.strategy.init_state(5)["model"].values())
    assert trainable == 85_806_346 and round(trainable / 2**20, 2) == 81.83     # Table 1, FedRep Param (M)
    assert sent == 85_798_656                                                   # the extractor; the head stays


def test_fedpft_setting_on_a_scratch_resnet8_runs_head_4_then_body_1_epochs(pft_files, tmp_path, monkeypatch):
    """FedPFT's FedRep (spec fedpft §4): R = 5 local epochs as 4 head epochs then 1 body epoch, BatchNorm shared."""
    from conftest import scratch_run
    from fedcore.methods.fedrep import FedRepClient

    calls = []
    original = FedRepClient.train_phase
    monkeypatch.setattr(FedRepClient, "train_phase", lambda self, model, names, data, settings, epochs: calls.append(
        (names[0], epochs)) or original(self, model, names, data, settings, epochs))
    res = scratch_run(pft_files, tmp_path / "rep", "fedrep", rounds=1, local_epochs=5, representation="backbone")
    assert calls == [("head.weight", 4), ("net.conv1.weight", 1)] * 4
    assert "net.bn1.running_mean" in res.global_state and set(res.personal_states[0]) == set(HEAD)
    assert all(math.isfinite(v) for v in res.metrics["value"])
