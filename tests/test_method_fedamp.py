"""FedAMP: the server's attention weights and cloud models against a hand computation, the client's proximal step,
the α_k schedule, and a run in which each client keeps its own model and sends only parameters."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch.func import functional_call
from torch.nn import functional as F

from conftest import scratch_run
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, module_state
from fedcore.methods.fedamp import FedAMP, alpha_at, attention_weights, flatten, unflatten

V = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])


def _method(**params) -> FedAMP:
    torch.manual_seed(0)
    return FedAMP(prompt_adapter(build_backbone("resnet8_pft_mini")), 4, params)


def test_distance_attention_by_hand():
    xi = attention_weights(V, "distance", alpha_k=0.5, sigma=2.0)
    d = {(0, 1): 1.0, (0, 2): 4.0, (1, 2): 5.0}                      # squared distances
    a = lambda x: 0.5 * math.exp(-x / 2.0) / 2.0                      # noqa: E731  α_k · A'(x), A'(x) = e^{-x/σ}/σ
    for i in range(3):
        for j in range(3):
            if i != j:
                assert xi[i, j].item() == pytest.approx(a(d[min(i, j), max(i, j)]), rel=1e-12)
        assert xi[i, i].item() == pytest.approx(1 - sum(a(d[min(i, j), max(i, j)]) for j in range(3) if j != i))
    assert torch.allclose(xi.sum(1), torch.ones(3, dtype=torch.float64))


def test_cosine_attention_by_hand():
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 3.0]])
    xi = attention_weights(w, "cosine", alpha_k=1.0, sigma=3.0, self_weight=0.2)
    c = 1 / math.sqrt(2)                                              # cos(w0, w1) = cos(w1, w2); cos(w0, w2) = 0
    e01, e02 = math.exp(3 * c), math.exp(0.0)
    assert xi[0, 0].item() == pytest.approx(0.2)
    assert xi[0, 1].item() == pytest.approx(0.8 * e01 / (e01 + e02)) and xi[0, 2].item() == pytest.approx(0.8 * e02 / (e01 + e02))
    assert xi[1, 0].item() == pytest.approx(0.4) and xi[1, 2].item() == pytest.approx(0.4)
    assert attention_weights(w[:1], "cosine", 1.0, 3.0, 0.2).tolist() == [[1.0]]


def test_alpha_decays_as_flings_every_30_rounds_after_round_31():
    p = {"alpha_k": 10000.0, "alpha_decay": 0.1, "alpha_decay_every": 30}
    assert [alpha_at(p, r) for r in (1, 2, 31, 32, 61, 62)] == pytest.approx([1e4, 1e4, 1e4, 1e3, 1e3, 1e2])
    assert alpha_at({**p, "alpha_decay": 1.0}, 500) == 1e4


def test_server_sends_each_client_its_weighted_cloud_model_and_the_proximal_weight():
    method = _method(alpha_k=0.5, sigma=2.0, lam=3.0)
    keys = method.trainable_keys(0)
    server = method.strategy.init_state(4)
    init = flatten(method.initial_state(0, keys), keys)
    first = method.strategy.configure(server, 2)
    assert torch.equal(flatten(first["anchor"], keys), init) and first["prox"] == pytest.approx(3.0 / 0.5)
    # clients 0, 1, 2 upload the initial model shifted by V's rows along the first two coordinates; 3 is absent
    ups = []
    for c in range(3):
        vec = init.clone()
        vec[:2] += V[c]
        ups.append(FitResult(c, 40, {"model": unflatten(vec, method.initial_state(0, keys), keys)}, {}))
    server = method.strategy.aggregate(RoundInfo(1, 4, 0.75, 0), server, ups)
    xi = attention_weights(V, "distance", 0.5, 2.0)
    for c in range(3):
        u = flatten(method.strategy.configure(server, c)["anchor"], keys)
        expected = init.double().clone()
        expected[:2] += (xi[c][:, None] * V.double()).sum(0)          # Σ_j ξ_cj (init + v_j) = init + Σ_j ξ_cj v_j
        assert torch.allclose(u.double(), expected, atol=1e-6), c
    assert torch.equal(flatten(method.strategy.configure(server, 3)["anchor"], keys), init)   # never heard from


def test_a_local_step_follows_ce_plus_lambda_over_alpha_times_the_distance_to_u():
    method = _method(alpha_k=2.0, lam=1.0)
    model, keys = method.model.train(), method.trainable_keys(0)
    start = module_state(model, keys)
    g = torch.Generator().manual_seed(0)
    anchor = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in start.items()}
    batch = Batch(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g), torch.arange(8), {})
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    ce = F.cross_entropy(functional_call(model, {**params, **buffers}, (batch.x,)), batch.y)
    ce_grad = dict(zip(params, torch.autograd.grad(ce, list(params.values())), strict=True))
    data = ClientData(0, 8, lambda: iter([batch]), torch.Generator())
    settings = TrainSettings(1, 8, {"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0})
    method.client.train(model, 0, {}, {"anchor": anchor, "prox": 1.0 / 2.0}, data, settings)
    after = module_state(model, keys)
    for k in keys:
        expected = start[k] - 0.1 * (ce_grad[k] + 0.5 * (start[k] - anchor[k]))
        assert torch.allclose(after[k], expected, atol=1e-6), k


def test_run_keeps_each_model_sends_parameters_only_and_resumes(pft_files, tmp_path, monkeypatch):
    uplinks = []
    original = type(_method().strategy).aggregate
    monkeypatch.setattr(type(_method().strategy), "aggregate", lambda self, info, state, results: uplinks.extend(
        r.uplink for r in results) or original(self, info, state, results))
    full = scratch_run(pft_files, tmp_path / "full", "fedamp", sigma=100.0)
    assert all(math.isfinite(v) for v in full.metrics["value"])
    params = {n for n, _ in _method().model.named_parameters()}
    assert len(uplinks) == 8 and all(set(u["model"]) == params for u in uplinks)          # no BatchNorm statistics
    states = full.personal_states
    assert set(states[0]) == set(_method().keys(0)) and "net.bn1.running_mean" in states[0]
    xi = full.server_state["xi"]
    assert torch.allclose(xi.sum(1), torch.ones(4, dtype=torch.float64)) and full.server_state["round"] == 2
    m = full.metrics
    assert m[(m.split == "global") & (m.client >= 0)]["client"].nunique() == 4              # each its own model
    assert scratch_run(pft_files, tmp_path / "cut", "fedamp", stop=1, sigma=100.0) is None
    resumed = scratch_run(pft_files, tmp_path / "cut", "fedamp", sigma=100.0)
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)


def test_self_weight_goes_with_cosine_only():
    with pytest.raises(ValueError, match="self_weight .* is required with attention: cosine"):
        FedAMP.check_params({**FedAMP.defaults, "attention": "cosine"})
    with pytest.raises(ValueError, match="unused with attention: distance"):
        FedAMP.check_params({**FedAMP.defaults, "self_weight": 0.3})
    FedAMP.check_params({**FedAMP.defaults, "attention": "cosine", "self_weight": 0.3})


def test_clients_of_different_architectures_are_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="same architecture"):
        FedAMP([prompt_adapter(build_backbone(a)) for a in ("resnet8_pft_mini", "resnet_mini_18")], 4,
               client_backbones=[0, 1])
