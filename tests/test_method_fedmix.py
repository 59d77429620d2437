"""FedMix: mean data from known images, the loss at lambda 0, its first-order match to global Mixup, a run."""
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
from fedcore.engine.roles import FitResult, module_state
from fedcore.methods.fedmix import FedMix, client_means, fedmix_loss
from fedcore.partition.make import make_partition
from fedcore.train import train_run


def _client(x: torch.Tensor, y: torch.Tensor, batch: int = 4, cid: int = 0, seed: int | None = None) -> ClientData:
    """ClientData over x, y in their given order (no shuffle), so the groups are known; its generator seeded with
    ``seed`` (default: the client id)."""
    def batches():
        for s in range(0, len(y), batch):
            idx = torch.arange(s, min(s + batch, len(y)))
            yield Batch(x[idx], y[idx], idx, {})
    return ClientData(cid, len(y), batches, torch.Generator().manual_seed(cid if seed is None else seed))


def _method(**params) -> FedMix:
    torch.manual_seed(0)
    return FedMix(PromptedViT(build_vit("vit_mini")), 4, params)


def _setup(m: FedMix, clients: list[ClientData]) -> dict:
    """The run's once-per-run exchange: every client's setup uplink, pooled into a fresh server state."""
    server = m.strategy.init_state(len(clients))
    m.strategy.setup(server, [FitResult(c.cid, c.num_samples, m.client.setup(c.cid, c), {}) for c in clients])
    return server


def test_client_means_are_group_averages_of_inputs_and_one_hot_labels():
    x = torch.arange(10 * 3 * 2 * 2, dtype=torch.float32).view(10, 3, 2, 2)
    y = torch.tensor([0, 1, 1, 2, 3, 3, 3, 0, 2, 1])
    xm, ym = client_means(_client(x, y), num_classes=4, mean_batch=3)  # batches of 4 cut across the groups
    assert xm.shape == (3, 3, 2, 2) and ym.shape == (3, 4)                # the 10th sample is dropped
    for g in range(3):
        assert torch.allclose(xm[g], x[3 * g:3 * g + 3].mean(0))
        assert torch.allclose(ym[g], F.one_hot(y[3 * g:3 * g + 3], 4).float().mean(0))
    xa, ya = client_means(_client(x, y), num_classes=4, mean_batch=0)   # 0: one mean of everything
    assert torch.allclose(xa[0], x.mean(0)) and torch.allclose(ya[0], torch.tensor([0.2, 0.3, 0.2, 0.3]))
    xb, _ = client_means(_client(x, y), num_classes=4, mean_batch=50)   # more than the client holds
    assert xb.shape[0] == 1 and torch.allclose(xb[0], x.mean(0))


def test_setup_pools_every_clients_means_in_server_state():
    m = _method(mean_batch=2)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 3, 16, 16, generator=g) for n in (4, 7)]
    ys = [torch.randint(0, 4, (n,), generator=g) for n in (4, 7)]
    clients = [_client(x, y, cid=c) for c, (x, y) in enumerate(zip(xs, ys))]
    state = _setup(m, clients)
    assert state["fedmix_x"].shape == (2 + 3, 3, 16, 16) and state["fedmix_x"].dtype == torch.float16
    assert torch.allclose(state["fedmix_y"].sum(1), torch.ones(5))
    assert torch.allclose(state["fedmix_x"][2].float(), xs[1][0:2].mean(0), atol=2e-3)  # client 1's first mean
    downlink = m.strategy.configure(state, 1)  # every client receives the whole pool
    assert torch.equal(downlink["fedmix_x"], state["fedmix_x"]) and torch.equal(downlink["fedmix_y"], state["fedmix_y"])
    with pytest.raises(ValueError, match=r"key 'lam' = 1.0: allowed \[0.0, 1.0\)"):  # checked when built, before setup
        _method(lam=1.0)


def test_loss_is_plain_cross_entropy_at_lambda_zero():
    m = _method()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, 16, 16, generator=g), torch.arange(6) % 4
    xm, ym = torch.randn(6, 3, 16, 16, generator=g), torch.softmax(torch.randn(6, 4, generator=g), 1)
    params = [p for p in m.model.parameters() if p.requires_grad]
    loss = fedmix_loss(m.model, x, y, xm, ym, lam=0.0)
    grads = torch.autograd.grad(loss, params)
    ref = F.cross_entropy(m.model(x), y)
    ref_grads = torch.autograd.grad(ref, params)
    assert torch.allclose(loss, ref, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads))
    lam = fedmix_loss(m.model, x, y, xm, ym, lam=0.1)
    assert not torch.allclose(lam, ref, atol=1e-3)  # the mean data do enter for lambda > 0


def test_loss_matches_global_mixup_to_first_order_in_lambda():
    """FedMix is Mixup with another client's raw data, Taylor-expanded to first order: the gap is O(lambda^2).
    Without the input-derivative term l3 (or with it mis-scaled) the gap is O(lambda)."""
    m = _method()
    m.model.double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 3, 16, 16, generator=g, dtype=torch.float64), torch.arange(5) % 4
    xm = torch.randn(5, 3, 16, 16, generator=g, dtype=torch.float64)
    ym = torch.softmax(torch.randn(5, 4, generator=g, dtype=torch.float64), 1)

    def mixup(lam: float) -> torch.Tensor:
        target = (1 - lam) * F.one_hot(y, 4).double() + lam * ym
        return F.cross_entropy(m.model((1 - lam) * x + lam * xm), target)

    def zeroth_order(lam: float) -> torch.Tensor:  # l1 + l2 only
        logits = m.model((1 - lam) * x)
        return ((1 - lam) * F.cross_entropy(logits, y) + lam * F.cross_entropy(logits, ym))

    def gap(fn, lam: float) -> float:
        return abs(float(fn(lam).detach()) - float(mixup(lam).detach()))

    def fedmix(lam: float) -> torch.Tensor:
        return fedmix_loss(m.model, x, y, xm, ym, lam)

    r = gap(fedmix, 0.02) / gap(fedmix, 0.01)
    assert 3.5 < r < 4.5, r                                    # halving lambda quarters the gap
    r0 = gap(zeroth_order, 0.02) / gap(zeroth_order, 0.01)
    assert 1.7 < r0 < 2.3, r0                                  # the first-order term is what l3 supplies
    assert gap(fedmix, 0.01) < 0.1 * gap(zeroth_order, 0.01)


def test_local_update_trains_with_the_pooled_means():
    m = _method()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 3, 16, 16, generator=g), torch.arange(12) % 4
    server = _setup(m, [_client(x, y)])
    before = {n: t.clone() for n, t in module_state(m.model, m.trainable_keys(0)).items()}
    _, result = m.client.fit(0, m.client.init_state(0), m.strategy.configure(server, 0), _client(x, y, batch=6),
                             TrainSettings(1, 6, {"name": "sgd", "lr": 0.1}))
    stats = result.stats
    after = module_state(m.model, m.trainable_keys(0))
    assert np.isfinite(stats["loss"])
    assert all(not torch.equal(before[n], after[n]) for n in before)  # prompts and head both move


@pytest.fixture(scope="module")
def learnable_files(learnable_run_files, tmp_path_factory):
    """The tiny blobs bundle, an IID 4-client partition and the briefly pretrained vit_mini."""
    root = tmp_path_factory.mktemp("fedmix")
    bundle = synthetic_bundle()
    save_bundle(bundle, root / "data.npz")
    make_partition({"scheme": "iid", "clients": 4}, 0, bundle.train.y, bundle.test.y).save(root / "part.npz")
    shutil.copy(learnable_run_files["weights"], root / "vit.pt")
    return root


def _run(root, tag: str):
    return train_run(run_params(rounds=3), identity("fedmix"), root / "data.npz", root / "part.npz", "vit_mini",
                     root / "vit.pt", root / f"{tag}.parquet", root / f"{tag}.pt", device="cpu", progress=False)


def test_fedmix_end_to_end_learns_and_is_deterministic(learnable_files):
    res = _run(learnable_files, "a")
    df = res.metrics
    assert np.isfinite(df["value"]).all()
    acc = df[(df.client == -1) & (df.split == "global") & (df.metric == "acc")]
    assert list(acc["round"]) == [1, 2, 3] and acc["value"].iloc[-1] > 0.5  # 4 classes: chance is 0.25
    assert res.server_state["fedmix_x"].shape == (4, 3, 16, 16)           # one mean per client (mean_batch 0)
    pd.testing.assert_frame_equal(df, _run(learnable_files, "b").metrics)
