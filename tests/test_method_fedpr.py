"""FedPR: the protected subspace of the global prompts, updates orthogonal to it, FedAvg, a whole run."""
from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import identity, run_params, synthetic_bundle
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import build_vit
from fedcore.data.arrays import save_bundle
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, load_state, module_state
from fedcore.methods.fedpr import FedPR, project_out, protected_basis
from fedcore.partition.make import make_partition
from fedcore.train import train_run

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}  # momentum + wd: the whole step projected


def _projector(basis: torch.Tensor) -> torch.Tensor:
    return basis @ basis.T


def _method(**params) -> FedPR:
    torch.manual_seed(0)
    return FedPR(PromptedViT(build_vit("vit_mini")), 4, params)


def _client(n: int = 24, batch: int = 8, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 16, 16, generator=g), torch.arange(n) % 4

    def batches():
        order = torch.randperm(n, generator=g)
        for s in range(0, n, batch):
            idx = order[s:s + batch]
            yield Batch(x[idx], y[idx], idx, {})
    return ClientData(0, n, batches, g)


def _shared(m: FedPR) -> list[str]:
    return m.client.shared_keys(m.keys(0))


def _prompt_names(m: FedPR) -> list[str]:
    """The per-block prompt tensors, the ones whose updates are projected."""
    return [n for n in m.trainable_keys(0) if n.startswith("prompts.")]


def _aggregate(m: FedPR, server: dict, uploads: list[dict], weights: list[float]) -> dict:
    """The strategy's next server state from one round's uploaded models."""
    results = [FitResult(c, w, {"model": u}, {}) for c, (u, w) in enumerate(zip(uploads, weights, strict=True))]
    return m.strategy.aggregate(RoundInfo(1, len(results), 1.0, 0), server, results)


def _fit(m: FedPR, server: dict, settings: TrainSettings) -> None:
    """One local update of client 0 from the server state's downlink (its model is left in ``m.model``)."""
    m.client.fit(0, m.client.init_state(0), m.strategy.configure(server, 0), _client(), settings)


def test_protected_basis_of_one_prompt_token_is_its_direction():
    p = torch.randn(1, 64, dtype=torch.float64)
    basis = protected_basis(p.T @ p, keep_ratio=0.8)
    assert basis.shape == (64, 1)  # rank 1: only the prompt's own direction, not 12 arbitrary null ones
    assert torch.allclose(_projector(basis), (p.T @ p) / (p @ p.T), atol=1e-10)


def test_protected_basis_is_the_top_singular_directions_up_to_the_ratio():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(20, 64, generator=g, dtype=torch.float64)      # rank 20 > int(64 * 0.2) = 12
    _, _, vh = torch.linalg.svd(p, full_matrices=False)
    basis = protected_basis(p.T @ p, keep_ratio=0.8)
    assert basis.shape == (64, 12)                                  # the official ratio rule
    assert torch.allclose(_projector(basis), vh[:12].T @ vh[:12], atol=1e-8)
    assert protected_basis(p.T @ p, keep_ratio=1.0).shape == (64, 0)
    assert protected_basis(torch.zeros(64, 64), keep_ratio=0.8).shape == (64, 0)  # zero prompts: nothing to keep
    with pytest.raises(ValueError, match="keep_ratio"):
        protected_basis(p.T @ p, keep_ratio=0.0)


def test_project_out_leaves_no_component_in_the_protected_subspace():
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(64, 5, generator=g))[0]
    step = torch.randn(3, 64, generator=g)
    out = project_out(step, basis)
    assert (out @ basis).abs().max() < 1e-5
    assert torch.allclose(project_out(out, basis), out, atol=1e-6)          # a projection
    assert torch.allclose((step - out) @ (torch.eye(64) - _projector(basis)), torch.zeros(3, 64), atol=1e-5)


def test_aggregate_is_fedavg_and_stores_the_global_prompts_directions():
    m = _method()
    names = _shared(m)
    assert sum(n.startswith("prompts.") for n in names) == 4             # VPT-deep: one token per vit_mini block
    server = m.strategy.init_state(2)
    assert server["fedpr_basis"] == {} and server["fedpr_cov"] == {}   # round 1: nothing protected
    a = {n: torch.randn_like(t) for n, t in module_state(m.model, names).items()}
    b = {n: torch.randn_like(t) for n, t in a.items()}
    server = _aggregate(m, server, [a, b], [1, 3])
    new = server["model"]
    for n in names:
        assert torch.allclose(new[n], 0.25 * a[n] + 0.75 * b[n], atol=1e-6)
    for n in _prompt_names(m):
        basis = server["fedpr_basis"][n]
        assert basis.shape == (64, 1)
        p = new[n].double()
        assert torch.allclose(_projector(basis.double()), (p.T @ p) / (p @ p.T), atol=1e-5)
    assert server["fedpr_cov"] == {}


def test_accumulated_covariance_protects_every_past_global_prompt():
    m = _method(accumulate=True)
    names = _shared(m)
    server = m.strategy.init_state(1)
    server = _aggregate(m, server, [{n: torch.randn_like(t) for n, t in module_state(m.model, names).items()}], [1])
    firsts = server["model"]
    server = _aggregate(m, server, [{n: torch.randn_like(t) for n, t in firsts.items()}], [1])
    seconds = server["model"]
    for n in _prompt_names(m):
        basis = server["fedpr_basis"][n]
        assert basis.shape == (64, 2)
        for p in (firsts[n], seconds[n]):  # both rounds' prompts lie in the protected span
            assert torch.allclose(p @ _projector(basis), p, atol=1e-5)


def test_local_update_moves_prompts_only_in_the_null_space_of_the_global_prompts():
    m = _method()
    names = _shared(m)
    start = module_state(m.model, names)
    server = _aggregate(m, m.strategy.init_state(1), [start], [1])  # the current prompts become the global ones
    _fit(m, server, TrainSettings(2, 8, SGD))
    end = module_state(m.model, names)
    for n in _prompt_names(m):
        delta = end[n] - start[n]
        basis = server["fedpr_basis"][n]
        assert delta.norm() > 1e-3                                  # the prompt did train ...
        assert (delta @ basis).abs().max() < 1e-6                   # ... but only orthogonally to the global one
    assert not torch.equal(end["head.weight"], start["head.weight"])  # the head is not projected

    # the same update without a protected subspace (round 1) does move along the global prompts
    load_state(m.model, start)
    protected = server["fedpr_basis"]
    _fit(m, {**m.strategy.init_state(1), "model": start}, TrainSettings(2, 8, SGD))
    free = module_state(m.model, names)
    assert max(float(((free[n] - start[n]) @ protected[n]).abs().max()) for n in _prompt_names(m)) > 1e-4


@pytest.fixture(scope="module")
def learnable_files(learnable_run_files, tmp_path_factory):
    """The tiny blobs bundle, an IID 4-client partition and the briefly pretrained vit_mini."""
    root = tmp_path_factory.mktemp("fedpr")
    bundle = synthetic_bundle()
    save_bundle(bundle, root / "data.npz")
    make_partition({"scheme": "iid", "clients": 4}, 0, bundle.train.y, bundle.test.y).save(root / "part.npz")
    shutil.copy(learnable_run_files["weights"], root / "vit.pt")
    return root


def _run(root, tag: str):
    return train_run(run_params(rounds=3), identity("fedpr"), root / "data.npz", root / "part.npz", "vit_mini",
                     root / "vit.pt", root / f"{tag}.parquet", root / f"{tag}.pt", device="cpu", progress=False)


def test_fedpr_end_to_end_learns_and_is_deterministic(learnable_files):
    res = _run(learnable_files, "a")
    df = res.metrics
    assert np.isfinite(df["value"]).all()
    acc = df[(df.client == -1) & (df.split == "global") & (df.metric == "acc")]
    assert list(acc["round"]) == [1, 2, 3] and acc["value"].iloc[-1] > 0.5  # 4 classes: chance is 0.25
    bases = res.server_state["fedpr_basis"]
    assert sorted(bases) == [f"prompts.{i}" for i in range(4)] and all(b.shape == (64, 1) for b in bases.values())
    pd.testing.assert_frame_equal(df, _run(learnable_files, "b").metrics)


def test_fedpr_resumes_with_its_protected_directions(learnable_files, tmp_path):
    """The bases live in server_state: a run cut after round 2 and resumed equals an uncut one."""
    def run(tag: str, stop: int | None = None):
        return train_run(run_params(rounds=3), identity("fedpr"), learnable_files / "data.npz",
                         learnable_files / "part.npz", "vit_mini", learnable_files / "vit.pt",
                         tmp_path / f"{tag}.parquet", tmp_path / f"{tag}.pt", checkpoint_path=tmp_path / f"{tag}.ckpt",
                         device="cpu", progress=False, stop_after_round=stop)

    full = run("full")
    assert run("cut", stop=2) is None
    pd.testing.assert_frame_equal(full.metrics, run("cut").metrics)
