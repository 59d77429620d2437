"""pFedSD (FedPFT baseline): the self-distillation loss against its formula, the first participation trains CE
only and later ones CE + λ·KD from the client's previous personalised model (SGD steps written out), the round
starts from the global model, and a 2-round run whose global model is the mean of the personalised ones."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.methods.pfedsd import PFedSD, self_distillation_loss
from fedcore.train import train_run

C = 4


def test_self_distillation_loss_is_t_squared_kl_of_softened_logits():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, C, generator=g), torch.randn(3, C, generator=g)
    T = 3.0
    p_t, p_s = torch.softmax(t / T, 1), torch.softmax(s / T, 1)
    hand = T * T * (p_t * (p_t.log() - p_s.log())).sum() / 3
    assert torch.allclose(self_distillation_loss(s, t, T), hand, atol=1e-6)
    assert float(self_distillation_loss(t, t, T)) == pytest.approx(0.0, abs=1e-6)


def _method(arch: str = "resnet8_pft_mini", **params) -> PFedSD:
    torch.manual_seed(0)
    return PFedSD(prompt_adapter(build_backbone(arch)), C, params)


def _data(n: int = 8) -> ClientData:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, 16, 16, generator=g), torch.randint(C, (n,), generator=g)
    return ClientData(0, n, lambda: iter([Batch(x, y, torch.arange(n), {})]), g)


SGD = TrainSettings(1, 8, {"name": "sgd", "lr": 0.1, "momentum": 0.0})


def _expected_step(method, start: dict, teacher: dict | None, batch: Batch, lam: float, temp: float) -> dict:
    """One plain SGD step of CE (+ λ·T²·KL to the teacher's train-mode logits) from ``start``, written out."""
    model = method.model
    if teacher is not None:
        model.load_state_dict(teacher)
        model.train()
        with torch.no_grad():
            target = model(batch.x)
    model.load_state_dict(start)
    model.train()
    logits = model(batch.x)
    loss = F.cross_entropy(logits, batch.y)
    if teacher is not None:
        p_t = torch.softmax(target / temp, 1)
        loss = loss + lam * temp ** 2 * (p_t * (p_t.log() - torch.log_softmax(logits / temp, 1))).sum(1).mean()
    names = method.trainable_keys(0)
    named = dict(model.named_parameters())
    grads = dict(zip(names, torch.autograd.grad(loss, [named[k] for k in names]), strict=True))
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}  # BatchNorm statistics after one pass
    return {k: (after[k] - 0.1 * grads[k]) if k in grads else after[k] for k in after}


def test_first_round_is_ce_only_and_later_rounds_distil_from_the_previous_personalised_model():
    method = _method(lam=0.5, temperature=3.0)
    data, model = _data(), method.model
    batch = next(data.batches())
    global0 = {k: v.clone() for k, v in model.state_dict().items()}
    down = {"model": global0}
    state0 = method.client.init_state(0)
    assert state0 == {"model": {}}
    expect1 = _expected_step(method, global0, None, batch, 0.5, 3.0)
    state1, res1 = method.client.fit(0, state0, down, data, SGD)
    for k, v in expect1.items():
        assert torch.allclose(state1["model"][k], v, atol=1e-6), k
        assert torch.equal(res1.uplink["model"][k], state1["model"][k]), k   # the whole model goes up
    # round 2: a new global model arrives; the client starts from it and distils from its personalised model
    global1 = {k: (v + 0.01 * torch.randn_like(v.float())).to(v.dtype) if v.is_floating_point() else v
               for k, v in global0.items()}
    expect2 = _expected_step(method, global1, state1["model"], batch, 0.5, 3.0)
    no_kd = _expected_step(method, global1, None, batch, 0.5, 3.0)
    state2, _ = method.client.fit(0, state1, {"model": global1}, data, SGD)
    for k, v in expect2.items():
        assert torch.allclose(state2["model"][k], v, atol=1e-6), k
    assert any(not torch.allclose(expect2[k], no_kd[k], atol=1e-6) for k in method.trainable_keys(0))


def _run(files, out, arch: str, rounds: int = 2):
    out.mkdir(exist_ok=True)
    params = {**run_params(rounds=rounds, participation=1.0), "method_params": {}}
    weights = files["weights"].get(arch)
    return train_run(params, identity("pfedsd"), files["dataset"], files["partition5"], arch, weights,
                     out / "m.parquet", out / "f.pt", progress=False)


@pytest.mark.parametrize("arch", ["resnet8_pft_mini", "resnet_mini_18"])
def test_two_rounds_the_global_model_is_the_mean_of_the_personalised_models(hetero_files, tmp_path, arch):
    res = _run(hetero_files, tmp_path / arch, arch)
    personal = res.personal_states
    assert sorted(personal) == [0, 1, 2, 3, 4]
    key = next(k for k in res.global_state if k.endswith("bn1.running_mean"))
    mean = torch.stack([personal[c][key] for c in range(5)]).mean(0)
    assert torch.allclose(res.global_state[key], mean, atol=1e-6)   # five clients of 48 samples: plain mean
    assert not torch.equal(personal[0][key], personal[1][key])
    method = _method(arch)   # the evaluator scores a client with its personalised model, a new one with the global
    evaluator, model = method.evaluator, method.model
    evaluator.load(model, 3, res.server_state, res.client_states[3], None)
    assert torch.equal(model.state_dict()[key], personal[3][key])
    evaluator.load(model, 3, res.server_state, method.client.init_state(3), None)
    assert torch.equal(model.state_dict()[key], res.global_state[key])
    m = res.metrics
    acc = m[(m["round"] == 2) & (m.split == "global") & (m.metric == "acc") & (m.client >= 0)]
    assert len(acc) == 5 and acc["value"].between(0, 1).all()
