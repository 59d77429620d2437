"""MoCo v3-style self-supervised pretraining of the tiny ViTs (mini scale): loss, momentum rule, views, seeds."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from fedcore.backbones.pretrain import objective_keys, pretrain
from fedcore.backbones.pretrain.moco import (MoCoV3, build_mlp, contrastive_loss, moco_loss, moco_momentum,
                                             momentum_update, two_views)
from fedcore.backbones.registry import build_backbone
from fedcore.config import ConfigError
from fedcore.config.experiments import check_backbone_entry
from fedcore.data.arrays import ArrayDataset, DatasetBundle

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def infonce_by_hand(q: list[list[float]], k: list[list[float]], t: float) -> float:
    """2t · mean_i [ -s_ii/t + log Σ_j exp(s_ij/t) ], s_ij the cosine of query i and key j, in plain Python."""
    unit = lambda v: [a / math.sqrt(sum(b * b for b in v)) for a in v]  # noqa: E731
    qs, ks = [unit(v) for v in q], [unit(v) for v in k]
    total = 0.0
    for i, qi in enumerate(qs):
        s = [sum(a * b for a, b in zip(qi, kj)) / t for kj in ks]
        total += -s[i] + math.log(sum(math.exp(x) for x in s))
    return 2 * t * total / len(qs)


def test_loss_matches_the_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    q1, q2, k1, k2 = (torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(4))
    t = 0.2
    got = contrastive_loss(q1, k2, t)
    assert got.item() == pytest.approx(infonce_by_hand(q1.tolist(), k2.tolist(), t), rel=1e-12)
    both = infonce_by_hand(q1.tolist(), k2.tolist(), t) + infonce_by_hand(q2.tolist(), k1.tolist(), t)
    assert moco_loss(q1, q2, k1, k2, t).item() == pytest.approx(both, rel=1e-12)
    # a perfect match (keys = queries, orthogonal rows) is far below chance; swapping the views is symmetric
    eye = torch.eye(4, dtype=torch.float64)
    assert contrastive_loss(eye, eye, t).item() < 2 * t * math.log(4) / 10
    assert moco_loss(q1, q2, k1, k2, t).item() == pytest.approx(moco_loss(q2, q1, k2, k1, t).item(), rel=1e-12)


def test_momentum_update_rule() -> None:
    torch.manual_seed(0)
    base, key = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    key[1].running_mean.fill_(7.0)
    before_q = [p.detach().clone() for p in base.parameters()]
    before_k = [p.detach().clone() for p in key.parameters()]
    m = 0.9
    momentum_update(base, key, m)
    for p_k, old_k, old_q in zip(key.parameters(), before_k, before_q):
        assert torch.allclose(p_k, m * old_k + (1 - m) * old_q, rtol=0, atol=1e-7)
    assert all(torch.equal(p, old) for p, old in zip(base.parameters(), before_q))  # the base is not touched
    assert torch.all(key[1].running_mean == 7.0)  # buffers are the key encoder's own
    assert moco_momentum(0, 100, 0.99) == pytest.approx(0.99)
    assert moco_momentum(50, 100, 0.99) == pytest.approx(0.995)
    assert moco_momentum(100, 100, 0.99) == pytest.approx(1.0)


def test_key_encoder_moves_by_momentum_only() -> None:
    torch.manual_seed(0)
    model = MoCoV3(build_backbone("vit_mini_s"), 32, proj_dim=8, mlp_dim=16)
    with torch.no_grad():  # the base drifts from the key encoder, as after some optimiser steps
        for p in model.base.parameters():
            p.add_(0.01 * torch.randn_like(p))
    base = [p.detach().clone() for p in model.base.parameters()]
    key = [p.detach().clone() for p in model.momentum.parameters()]
    v1, v2 = torch.randn(6, 3, 16, 16), torch.randn(6, 3, 16, 16)
    model(v1, v2, 0.8, 0.2).backward()
    for p_k, old_k, old_q in zip(model.momentum.parameters(), key, base):
        assert torch.allclose(p_k, 0.8 * old_k + 0.2 * old_q, rtol=0, atol=1e-6)
        assert p_k.grad is None and not p_k.requires_grad
    assert all(p.grad is not None for p in model.predictor.parameters())
    heads = build_mlp(3, 32, 16, 8)  # the repo's layout: Linear/BN/ReLU x2, Linear, BN without affine
    assert [type(m).__name__ for m in heads] == ["Linear", "BatchNorm1d", "ReLU"] * 2 + ["Linear", "BatchNorm1d"]
    assert heads[-1].weight is None and heads[0].bias is None


def _bundle(n: int = 64, seed: int = 0, labels: np.ndarray | None = None) -> DatasetBundle:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 255, (n, 16, 16, 3)).astype(np.uint8)
    ds = ArrayDataset(x, rng.integers(0, 4, n) if labels is None else labels)
    return DatasetBundle(train=ds, test=ds, pretrain=ds, meta=dict(classes=list("abcd")))


def test_views_are_seeded_and_differ() -> None:
    x = torch.from_numpy(_bundle(8).pretrain.x)
    args = (0.4, 0.4, 16, (0.5,) * 3, (0.5,) * 3)
    a1, a2 = two_views(x, torch.Generator().manual_seed(3), *args)
    b1, b2 = two_views(x, torch.Generator().manual_seed(3), *args)
    assert a1.shape == (8, 3, 16, 16) and torch.equal(a1, b1) and torch.equal(a2, b2)
    assert not torch.allclose(a1, a2)
    assert a1.min() >= -1 - 1e-6 and a1.max() <= 1 + 1e-6  # [0, 1] images normalised by mean = std = 0.5


def test_pretraining_is_seeded_and_label_free(tmp_path) -> None:
    kw = dict(epochs=1, batch_size=32, lr=1e-3, proj_dim=8, mlp_dim=16, threads=1, progress=False)
    s1 = pretrain(_bundle(), "vit_mini_s", "digits_moco", objective="moco", out_path=tmp_path / "a.pt", **kw)
    pretrain(_bundle(labels=np.zeros(64, np.int64)), "vit_mini_s", objective="moco", out_path=tmp_path / "b.pt",
             **kw)
    pretrain(_bundle(), "vit_mini_s", objective="moco", out_path=tmp_path / "c.pt", seed=1, **kw)
    w1, w2, w3 = (torch.load(tmp_path / f"{n}.pt") for n in "abc")
    assert set(w1) == set(build_backbone("vit_mini_s").state_dict())  # the backbone only: no heads
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # other labels, same weights: labels are never read
    assert not all(torch.equal(w1[k], w3[k]) for k in w1)  # another seed, other weights
    assert s1["steps"] == 2 and s1["objective"] == "moco" and math.isfinite(s1["final_loss"])
    assert torch.get_num_threads() == 1
    build_backbone("vit_mini_s", tmp_path / "a.pt", "digits_moco")  # loads strictly through the registry


def test_pretrain_settings_follow_the_objective() -> None:
    assert "label_smoothing" in objective_keys("supervised") and "temperature" in objective_keys("moco")
    entry = {"arch": "vit_mini", "tag": "digits_moco", "pretrain": {"objective": "moco", "label_smoothing": 0.1}}
    with pytest.raises(ConfigError, match=r"\(vit_x\) at pretrain: \['label_smoothing'\] are not settings of the "
                                          r"moco objective; it takes \[.*'temperature'"):
        check_backbone_entry("vit_x", entry, Path("config/backbones.yaml"))
    with pytest.raises(ConfigError, match="unknown weight tag 'digits_mocov' for arch 'vit_mini'"):
        check_backbone_entry("vit_x", {"arch": "vit_mini", "tag": "digits_mocov", "pretrain": {}}, Path("b.yaml"))
    with pytest.raises(ValueError, match="moco pretraining|written for ViTs"):
        pretrain(_bundle(), "resnet_mini_18", objective="moco", epochs=1, batch_size=32, progress=False)
    entries = yaml.safe_load((ROOT / "config" / "backbones.yaml").read_text())
    moco = {k: e["arch"] for k, e in entries.items() if e.get("pretrain", {}).get("objective") == "moco"}
    assert moco == {"vit_mini_s_moco": "vit_mini_s", "vit_mini_moco": "vit_mini", "vit_mini_l_moco": "vit_mini_l"}
