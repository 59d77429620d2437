"""FedCAC (FedPFT baseline): critical parameters by sensitivity (hand-computed), the overlap rate and the
collaboration threshold (hand-computed), the customised model and the start of a round (critical parameters from
it, the rest from the global model, BatchNorm statistics the client's own), and a 2-round run."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.roles import FitResult, RoundInfo
from fedcore.methods.fedcac import FedCAC, collaborators, critical_mask, overlap_rates
from fedcore.train import train_run

C = 4


def test_critical_parameters_are_the_top_tau_by_update_times_value():
    before = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 2.0])
    after = torch.tensor([2.0, 0.5, 1.0, -3.0, 0.0, 2.5])
    # |(after - before) * after| = [2, 0.25, 0, 12, 0, 1.25]; tau 0.5: the top 3 (12, 2, 1.25)
    assert critical_mask(before, after, 0.5).tolist() == [True, False, False, True, False, True]
    # tau 0.9: the 5th largest is 0, replaced by the smallest nonzero sensitivity (0.25): every nonzero one
    assert critical_mask(before, after, 0.9).tolist() == [True, True, False, True, False, True]
    assert not critical_mask(before, after, 0.1).any()            # int(0.1 * 6) = 0: nothing is critical
    assert critical_mask(before.reshape(2, 3), after.reshape(2, 3), 0.5).shape == (2, 3)


def test_overlap_rates_and_the_collaboration_threshold_by_hand():
    masks = [torch.tensor(m, dtype=torch.bool) for m in ([1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1])]
    rates = overlap_rates(masks, chunk=3)                         # chunks of 3 columns: the sums still add up
    # 1 - |c_i - c_j|_1 / (2 |c_i|_1): c0 vs c1 differ in 2 places of 2 critical each -> 0.5
    expected = torch.tensor([[1, .5, 1, 0], [.5, 1, .5, .5], [1, .5, 1, 0], [0, .5, 0, 1]], dtype=torch.float64)
    assert torch.allclose(rates, expected)
    off = [expected[i, j] for i in range(4) for j in range(4) if i != j]
    mean, top = sum(off) / 12, max(off)
    for rnd, beta in ((1, 100), (50, 100), (100, 100)):
        thr = mean + rnd / beta * (top - mean)
        hand = [[j for j in range(4) if j == i or expected[i, j] >= thr] for i in range(4)]
        assert collaborators(rates, rnd, beta) == hand
    assert collaborators(rates, 1, 100) == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2], [1, 3]]
    assert collaborators(rates, 100, 100) == [[0, 2], [1], [0, 2], [3]]   # at t = beta: only the closest


def _method(arch: str = "resnet8_pft_mini", **params) -> FedCAC:
    torch.manual_seed(0)
    return FedCAC(prompt_adapter(build_backbone(arch)), C, params)


def test_the_round_starts_from_critical_customised_and_other_global_parameters_with_own_statistics():
    method = _method()
    strategy, client, model = method.strategy, method.client, method.model
    keys = method.trainable_keys(0)
    assert set(client.shared_keys(method.keys(0))) == set(keys)               # parameters only go up
    buffers = client.personal_keys(method.keys(0))
    assert buffers and all("running" in k or "num_batches" in k for k in buffers)
    server = strategy.init_state(3)
    g = torch.Generator().manual_seed(2)
    ups = [{k: torch.randn(v.shape, generator=g) for k, v in server["model"].items()} for _ in range(3)]
    total = sum(v.numel() for v in server["model"].values())
    crit = [torch.rand(total, generator=g) < 0.5 for _ in range(3)]
    crit[2] = crit[0].clone()                                   # clients 0 and 2 share their critical set
    results = [FitResult(c, 10 * (c + 1), {"model": ups[c], "critical": crit[c]}, {}) for c in range(3)]
    new = strategy.aggregate(RoundInfo(1, 3, 1.0, 0), server, results)
    k0 = keys[0]
    weighted = sum((c + 1) * ups[c][k0] for c in range(3)) / 6
    assert torch.allclose(new["model"][k0], weighted, atol=1e-6)              # global: weighted by samples
    rates = overlap_rates(crit)
    assert new["collaborators"] == dict(enumerate(collaborators(rates, 1, 100)))
    down = strategy.configure(new, 0)
    group = new["collaborators"][0]
    assert torch.allclose(down["customized"][k0], sum(ups[c][k0] for c in group) / len(group), atol=1e-6)
    own = {k: torch.full_like(v, 7.0) for k, v in method.initial_state(0, buffers).items()}
    client.start(model, 0, {"model": own, "critical": crit[0]}, down)
    masks = method.split_mask(0, crit[0])
    state = model.state_dict()
    for k in keys:
        expected = torch.where(masks[k], down["customized"][k], new["model"][k])
        assert torch.equal(state[k], expected), k
    assert all(torch.equal(state[k], own[k]) for k in buffers)
    client.start(model, 1, {"model": own}, {"model": new["model"]})          # no critical set yet: the global
    assert torch.equal(model.state_dict()[k0], new["model"][k0])


@pytest.mark.parametrize("arch", ["resnet8_pft_mini", "resnet_mini_18"])
def test_two_rounds_upload_parameters_and_critical_sets_and_keep_statistics_personal(hetero_files, tmp_path, arch):
    out = tmp_path / arch
    out.mkdir()
    params = {**run_params(rounds=2, participation=1.0), "method_params": {"tau": 0.4, "beta": 2}}
    res = train_run(params, identity("fedcac"), hetero_files["dataset"], hetero_files["partition5"], arch,
                    hetero_files["weights"].get(arch), out / "m.parquet", out / "f.pt", progress=False)
    server = res.server_state
    method = _method(arch)
    total = sum(p.numel() for p in method.model.parameters())
    assert sorted(server["critical"]) == [0, 1, 2, 3, 4]
    for c in range(5):
        frac = float(server["critical"][c].float().mean())
        # at most tau of every tensor (fewer where a 3x3 kernel sees a 1x1 map: only its centre moves)
        assert server["critical"][c].numel() == total and 0.2 < frac <= 0.45
        assert not any("running" in k for k in server["uploads"][c])
    key = next(k for k in res.client_states[0]["model"] if k.endswith("running_mean"))
    assert not torch.equal(res.client_states[0]["model"][key], res.client_states[1]["model"][key])
    assert all(c in g for c, g in server["collaborators"].items())
    m = res.metrics
    acc = m[(m["round"] == 2) & (m.split == "local") & (m.metric == "acc")]
    assert len(acc) == 5 and acc["value"].between(0, 1).all() and math.isfinite(m["value"].sum())
