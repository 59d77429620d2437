"""FedEM: responsibilities, the E/M steps, the mixture prediction, per-component FedAvg, a whole run."""
from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from torch.nn import functional as F

from conftest import identity, run_params, synthetic_bundle
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import build_vit
from fedcore.data.arrays import save_bundle
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, load_state, module_state
from fedcore.methods.base import PromptClassifier
from fedcore.methods.fedem import FedEM, responsibilities
from fedcore.partition.make import make_partition
from fedcore.train import train_run


def _method(**params) -> FedEM:
    torch.manual_seed(0)
    return FedEM(PromptedViT(build_vit("vit_mini")), 4, params)


def _data(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g), torch.arange(n) % 4


def _client(x: torch.Tensor, y: torch.Tensor, batch: int = 8) -> ClientData:
    g = torch.Generator().manual_seed(0)

    def batches():
        order = torch.randperm(len(y), generator=g)
        for s in range(0, len(y), batch):
            idx = order[s:s + batch]
            yield Batch(x[idx], y[idx], idx, {})
    return ClientData(0, len(y), batches, g)


def _predict(m: FedEM, x: torch.Tensor) -> torch.Tensor:
    """The evaluator's prediction for a batch of images (labels unused)."""
    return m.evaluator.predict(m.model, Batch(x, torch.zeros(len(x), dtype=torch.long), torch.arange(len(x)), {}))


def _shared(m: FedEM) -> list[str]:
    return m.client.shared_keys(m.keys(0))


def test_state_ownership_components_shared_and_mixture_weights_personal():
    m = _method()
    assert m.client.personal_keys(m.keys(0)) == ["pi"] and "pi" not in _shared(m)
    assert set(_shared(m)) == {"prompts", "head.weight", "head.bias"}
    assert not m.model.pi.requires_grad and torch.allclose(m.model.pi, torch.full((3,), 1 / 3))
    assert m.model.prompts.shape == (3, 1, 64) and m.model.head.weight.shape == (3, 4, 64)
    # independent inits: identical components would receive identical updates and never separate
    assert not torch.equal(m.model.prompts[0], m.model.prompts[1])
    assert not torch.equal(m.model.head.weight[0], m.model.head.weight[1])


def test_responsibilities_are_a_posterior_over_components():
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(3, 10, generator=g) * 3
    pi = torch.tensor([0.2, 0.5, 0.3])
    q = responsibilities(losses, pi)
    assert torch.allclose(q.sum(0), torch.ones(10))
    manual = pi[:, None] * torch.exp(-losses)
    assert torch.allclose(q, manual / manual.sum(0, keepdim=True), atol=1e-6)
    assert torch.equal(responsibilities(losses, torch.tensor([0.0, 1.0, 0.0]))[1], torch.ones(10))


def test_component_logits_equal_each_component_run_on_its_own():
    m = _method()
    x, _ = _data(6)
    stacked = m.model.component_logits(x)
    for k in range(3):
        single = PromptClassifier(m.backbones[0], 4, "shallow", 1)
        with torch.no_grad():
            single.prompts[0].copy_(m.model.prompts[k])
            single.head.weight.copy_(m.model.head.weight[k])
            single.head.bias.copy_(m.model.head.bias[k])
        assert torch.allclose(stacked[k], single(x), atol=1e-5), k


def test_prediction_is_the_pi_weighted_mixture_of_component_softmaxes():
    m = _method()
    x, _ = _data(6)
    pi = torch.tensor([0.6, 0.1, 0.3])
    load_state(m.model, {"pi": pi})
    probs = F.softmax(m.model.component_logits(x).detach(), dim=-1)
    expected = (pi[:, None, None] * probs).sum(0)
    assert torch.allclose(_predict(m, x).exp(), expected, atol=1e-6)
    load_state(m.model, {"pi": torch.tensor([0.0, 0.0, 1.0])})  # a one-hot pi predicts with that component alone
    assert torch.allclose(_predict(m, x), F.log_softmax(m.model.component_logits(x)[2], -1), atol=1e-5)


def test_local_update_sets_pi_to_mean_responsibilities_and_weights_the_m_step():
    m = _method()
    x, y = _data(16)
    pi = torch.tensor([0.5, 0.5, 0.0])  # component 2 is responsible for nothing on this client
    load_state(m.model, {"pi": pi})
    start = module_state(m.model, m.keys(0))  # the components and pi
    with torch.no_grad():
        losses = F.cross_entropy(m.model.component_logits(x).flatten(0, 1), y.repeat(3), reduction="none")
        expected_pi = responsibilities(losses.view(3, -1), pi).mean(1)
    downlink = m.strategy.configure({"model": module_state(m.model, _shared(m))}, 0)
    new_state, result = m.client.fit(0, {"model": {"pi": pi}}, downlink, _client(x, y),
                                     TrainSettings(2, 8, {"name": "sgd", "lr": 0.1, "momentum": 0.9}))
    end = module_state(m.model, m.keys(0))
    assert set(new_state["model"]) == {"pi"} and torch.equal(new_state["model"]["pi"], end["pi"])  # pi stays
    assert set(result.uplink["model"]) == set(_shared(m))                                        # components go up
    assert all(torch.equal(result.uplink["model"][n], end[n]) for n in _shared(m))
    assert torch.allclose(end["pi"], expected_pi, atol=1e-6) and abs(float(end["pi"].sum()) - 1) < 1e-6
    assert not torch.allclose(end["pi"], pi)
    for name in ("prompts", "head.weight", "head.bias"):
        assert torch.equal(end[name][2], start[name][2])        # zero responsibility: zero weight, no update
        assert not torch.equal(end[name][:2], start[name][:2])  # the responsible components train


def test_aggregation_averages_each_component_by_sample_size():
    m = _method()
    names = _shared(m)
    g = torch.Generator().manual_seed(3)
    ups = [{n: torch.randn(t.shape, generator=g) for n, t in module_state(m.model, names).items()} for _ in range(2)]
    results = [FitResult(0, 30, {"model": ups[0]}, {}), FitResult(1, 10, {"model": ups[1]}, {})]
    new = m.strategy.aggregate(RoundInfo(1, 2, 1.0, 0), m.strategy.init_state(2), results)["model"]
    assert set(new) == set(names)  # pi never reaches the server
    for n in names:
        for k in range(3):
            assert torch.allclose(new[n][k], 0.75 * ups[0][n][k] + 0.25 * ups[1][n][k], atol=1e-6)


@pytest.fixture(scope="module")
def learnable_files(learnable_run_files, tmp_path_factory):
    """The tiny blobs bundle, a 2-classes-per-client partition and the briefly pretrained vit_mini."""
    root = tmp_path_factory.mktemp("fedem")
    bundle = synthetic_bundle()
    save_bundle(bundle, root / "data.npz")
    make_partition({"scheme": "classes_per_client", "clients": 4, "classes_per_client": 2}, 0,
                   bundle.train.y, bundle.test.y).save(root / "part.npz")
    shutil.copy(learnable_run_files["weights"], root / "vit.pt")
    return root


def _run(root, tag: str):
    return train_run(run_params(rounds=3), identity("fedem"), root / "data.npz", root / "part.npz", "vit_mini",
                     root / "vit.pt", root / f"{tag}.parquet", root / f"{tag}.pt", device="cpu", progress=False)


def test_fedem_end_to_end_learns_personalises_and_is_deterministic(learnable_files):
    res = _run(learnable_files, "a")
    df = res.metrics
    assert np.isfinite(df["value"]).all()
    acc = df[(df.client == -1) & (df.split == "global") & (df.metric == "acc")]
    local = df[(df.client == -1) & (df.metric == "acc_mean")]
    assert list(acc["round"]) == [1, 2, 3]
    assert acc["value"].iloc[-1] > 0.5 and local["value"].iloc[-1] > 0.5  # 4 classes: chance is 0.25
    assert set(df[(df.split == "global") & (df.client >= 0)].client) == {0, 1, 2, 3}  # one model per client
    assert set(res.global_state) == {"prompts", "head.weight", "head.bias"}
    assert res.personal_states  # the trained clients' own mixture weights
    for state in res.personal_states.values():
        assert set(state) == {"pi"} and abs(float(state["pi"].sum()) - 1) < 1e-5
    pd.testing.assert_frame_equal(df, _run(learnable_files, "b").metrics)
