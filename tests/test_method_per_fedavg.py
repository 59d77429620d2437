"""Per-FedAvg (FO): the meta-step and the evaluation-time adaptation against hand computations; end to end."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch.func import functional_call
from torch.nn import functional as F

from conftest import identity, run_params
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import build_vit
from fedcore.methods import method_class
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import load_state, module_state
from fedcore.methods.per_fedavg import halves
from fedcore.train import train_run

NAMES = ["prompts.0", "head.weight", "head.bias"]


def _method(**params):
    torch.manual_seed(0)
    return method_class("per_fedavg")(PromptedViT(build_vit("vit_mini")), 4, params)


def _batches(n: int, size: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 16, 16, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(n)]


def _client(batches) -> ClientData:
    as_batches = [Batch(x, y, torch.arange(len(y)), {}) for x, y in batches]
    return ClientData(0, sum(len(y) for _, y in batches), lambda: iter(as_batches), torch.Generator())


def _eval_state(method, cid: int, state: dict[str, torch.Tensor], data: ClientData) -> dict[str, torch.Tensor]:
    """The model that scores client ``cid`` when the server's model is ``state`` (it keeps no personal tensors)."""
    method.evaluator.load(method.model, cid, {"model": state}, method.client.init_state(cid), data)
    return module_state(method.model, NAMES)


def _local_update(method, state: dict[str, torch.Tensor], data: ClientData, settings: TrainSettings) -> dict:
    """One local update of client 0 from the global model ``state``; returns its stats (the model stays trained)."""
    downlink = method.strategy.configure({"model": state}, 0)
    _, result = method.client.fit(0, method.client.init_state(0), downlink, data, settings)
    return result.stats


def _perturbed_state(method) -> dict[str, torch.Tensor]:
    """A global state away from initialisation (a nonzero head makes the prompt gradient nonzero)."""
    g = torch.Generator().manual_seed(3)
    return {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in module_state(method.model, NAMES).items()}


def _ce_grads(method, state: dict[str, torch.Tensor], x, y) -> dict[str, torch.Tensor]:
    """Gradients of the batch cross-entropy at ``state`` through an independent functional forward."""
    params = {n: t.clone().requires_grad_(True) for n, t in state.items()}
    loss = F.cross_entropy(functional_call(method.model, params, (x,)), y)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def test_halves_split_each_minibatch_into_inner_and_outer_batches():
    x, y = torch.arange(7.0), torch.arange(7)
    (_, y1), (_, y2) = halves(x, y)
    assert y1.tolist() == [0, 1, 2] and y2.tolist() == [3, 4, 5, 6]
    (a, _), (b, _) = halves(x[:1], y[:1])
    assert torch.equal(a, b)  # a single sample serves as both D and D'


def test_eval_state_is_one_sgd_step_of_size_alpha_on_a_train_batch():
    alpha = 0.5
    method = _method(alpha=alpha)
    state = _perturbed_state(method)
    (x, y), = batches = _batches(1)
    out = _eval_state(method, 0, state, _client(batches))
    assert any(not torch.allclose(out[n], state[n]) for n in NAMES)  # evaluation uses an adapted model
    assert all(not torch.equal(out[n], state[n]) for n in NAMES)

    # the head's gradient by hand: d CE / d W = (softmax - onehot)^T feats / B
    load_state(method.model, state)
    with torch.no_grad():
        feats = method.model.features(x)
        err = (torch.softmax(feats @ state["head.weight"].T + state["head.bias"], dim=1)
               - F.one_hot(y, 4).float()) / len(y)
    assert torch.allclose(out["head.weight"], state["head.weight"] - alpha * err.T @ feats, atol=1e-6)
    assert torch.allclose(out["head.bias"], state["head.bias"] - alpha * err.sum(0), atol=1e-6)
    g = _ce_grads(method, state, x, y)
    assert torch.allclose(out["prompts.0"], state["prompts.0"] - alpha * g["prompts.0"], atol=1e-6)


def test_eval_state_takes_eval_steps_steps_on_successive_batches():
    alpha = 0.3
    method = _method(alpha=alpha, eval_steps=2)
    state = _perturbed_state(method)
    batches = _batches(2)
    out = _eval_state(method, 0, state, _client(batches))
    w = dict(state)
    for x, y in batches:
        g = _ce_grads(method, w, x, y)
        w = {n: w[n] - alpha * g[n] for n in NAMES}
    for n in NAMES:
        assert torch.allclose(out[n], w[n], atol=1e-6), n


def test_local_step_is_the_first_order_meta_step():
    alpha, beta, wd = 0.5, 0.2, 0.01
    method = _method(alpha=alpha, beta=beta)
    state = _perturbed_state(method)
    batches = _batches(1)
    settings = TrainSettings(1, 8, {"name": "sgd", "lr": 123.0, "momentum": 0.9, "weight_decay": wd})
    stats = _local_update(method, state, _client(batches), settings)
    out = module_state(method.model, NAMES)

    (x1, y1), (x2, y2) = halves(*batches[0])
    g_inner = _ce_grads(method, state, x1, y1)
    adapted = {n: state[n] - alpha * g_inner[n] for n in NAMES}
    g_outer = _ce_grads(method, adapted, x2, y2)
    for n in NAMES:  # w <- w - beta * (grad f(w - alpha grad f(w; D); D') + wd * w); momentum is inert at step 1
        assert torch.allclose(out[n], state[n] - beta * (g_outer[n] + wd * state[n]), atol=1e-6), n
    plain = _ce_grads(method, state, x2, y2)  # not FedAvg's step: the gradient is taken at the adapted point
    assert not torch.allclose(out["head.weight"], state["head.weight"] - beta * (plain["head.weight"]
                                                                                + wd * state["head.weight"]))
    load_state(method.model, adapted)
    with torch.no_grad():
        assert stats["loss"] == pytest.approx(float(F.cross_entropy(method.model(x2), y2)), rel=1e-5)


def test_beta_defaults_to_the_experiment_lr():
    method = _method(alpha=0.0)  # alpha 0: the meta-step is plain SGD on D'
    state = _perturbed_state(method)
    batches = _batches(1)
    _local_update(method, state, _client(batches), TrainSettings(1, 8, {"name": "sgd", "lr": 0.3}))
    g = _ce_grads(method, state, *halves(*batches[0])[1])
    assert torch.allclose(module_state(method.model, ["head.bias"])["head.bias"],
                          state["head.bias"] - 0.3 * g["head.bias"], atol=1e-6)


# ---- end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_files(learnable_run_files):
    return learnable_run_files


def _train(files, work):
    work.mkdir()
    params = run_params(rounds=3, participation=1.0, local_epochs=1)  # not batched: the slowest of the three
    params["optimizer"]["lr"] = 0.01
    return train_run(params, identity("per_fedavg"), files["dataset"], files["partition"], "vit_mini",
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
    assert set(a.global_state) == set(NAMES) and a.personal_states == {}
    assert set(m[(m.client >= 0) & (m.split == "global")]["client"]) == {0, 1, 2, 3}  # scored per client
