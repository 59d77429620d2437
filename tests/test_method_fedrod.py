"""FedRoD: the generic head and body learn from the balanced-softmax loss, the personal head from CE of the
summed logits on detached features; prediction = generic + personal logits; body and generic head are shared."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import scratch_run
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData
from fedcore.methods.fedrod import COUNTS, FedRoD, balanced_softmax_loss, label_counts, rod_logits
from fedcore.partition.file import Partition


def _method(arch: str = "resnet8_pft_mini", **params) -> FedRoD:
    torch.manual_seed(0)
    return FedRoD(prompt_adapter(build_backbone(arch)), 3, params)


def _batch(seed: int = 0, n: int = 8) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(n, 3, 16, 16, generator=g), torch.tensor([0, 1] * (n // 2)), torch.arange(n), {})


def test_balanced_softmax_shifts_logits_by_log_counts_by_hand():
    logits, labels, counts = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 3.0]]), torch.tensor([0, 1]), \
        torch.tensor([3.0, 1.0, 0.0])
    # row 0: z = (1 + ln 3, 2 + ln 1, -inf); row 1: z = (0.5 + ln 3, 0, -inf): the absent class never counts
    r0 = -(1 + math.log(3)) + math.log(math.exp(1 + math.log(3)) + math.exp(2))
    r1 = -0.0 + math.log(math.exp(0.5 + math.log(3)) + math.exp(0.0))
    assert balanced_softmax_loss(logits, labels, counts).item() == pytest.approx((r0 + r1) / 2, rel=1e-6)


def test_label_counts_leave_the_training_batches_unchanged():
    labels = torch.tensor([0, 2, 2, 1, 2, 0, 2])
    gen = torch.Generator().manual_seed(3)

    def batches():
        order = torch.randperm(7, generator=gen)
        return iter([Batch(torch.zeros(4, 1), labels[order[:4]], order[:4], {}),
                     Batch(torch.zeros(3, 1), labels[order[4:]], order[4:], {})])

    data = ClientData(0, 7, batches, gen)
    assert label_counts(data, 4).tolist() == [2.0, 1.0, 4.0, 0.0]
    after = [b.index for b in data.batches()]
    gen.manual_seed(3)
    assert all(torch.equal(a, b.index) for a, b in zip(after, data.batches()))   # same order as without the count


@pytest.mark.parametrize("detach, body_sees_ce", [(True, False), (False, True)])
def test_each_loss_reaches_only_its_own_tensors(detach, body_sees_ce):
    method = _method(detach_personal=detach)
    model = method.model.train()
    getattr(model, COUNTS).copy_(torch.tensor([5.0, 3.0, 0.0]))
    batch = _batch()
    g, p = rod_logits(model, batch.x, detach)
    bsm, ce = balanced_softmax_loss(g, batch.y, getattr(model, COUNTS)), torch.nn.functional.cross_entropy(p, batch.y)
    named = dict(model.named_parameters())
    grads = {name: torch.autograd.grad(loss, list(named.values()), retain_graph=True, allow_unused=True)
             for name, loss in (("bsm", bsm), ("ce", ce))}
    touched = {name: {k for k, gr in zip(named, gs) if gr is not None and gr.abs().sum() > 0}
               for name, gs in grads.items()}
    assert {"head.weight", "net.conv1.weight"} <= touched["bsm"] and not any(k.startswith("phead") for k in touched["bsm"])
    assert {"phead.weight", "phead.bias"} <= touched["ce"] and "head.weight" not in touched["ce"]
    assert ("net.conv1.weight" in touched["ce"]) == body_sees_ce
    total = method.client.loss(model, batch)
    assert total.item() == pytest.approx((bsm + ce).item(), rel=1e-6)


def test_prediction_is_generic_plus_personal_logits_and_personal_head_starts_as_the_generic_one():
    method = _method()
    model = method.model.eval()
    assert torch.equal(model.phead.weight, model.head.weight)
    with torch.no_grad():
        model.phead.weight.add_(0.3)
        batch = _batch()
        z = model.features(batch.x)
        expected = model.head(z) + model.phead(z)
    assert torch.allclose(method.evaluator.predict(model, batch), expected, atol=1e-6)
    keys = method.keys(0)
    assert method.client.personal_keys(keys) == ["phead.weight", "phead.bias", COUNTS]
    assert set(method.client.shared_keys(keys)) == set(keys) - {"phead.weight", "phead.bias", COUNTS}


def test_run_counts_each_clients_labels_shares_body_and_generic_head_and_resumes(pft_files, tmp_path):
    full = scratch_run(pft_files, tmp_path / "full", "fedrod")
    assert all(math.isfinite(v) for v in full.metrics["value"])
    assert {"head.weight", "net.conv1.weight", "net.bn1.running_mean"} <= set(full.global_state)
    assert not any(k.startswith("phead") or k == COUNTS for k in full.global_state)
    part = Partition.load(pft_files["partition"])
    from fedcore.data.arrays import load_bundle
    y = load_bundle(pft_files["dataset"]).train.y
    for c in range(4):
        assert full.personal_states[c][COUNTS].tolist() == np.bincount(y[part.train[c]], minlength=4).tolist()
    assert scratch_run(pft_files, tmp_path / "cut", "fedrod", stop=1) is None
    resumed = scratch_run(pft_files, tmp_path / "cut", "fedrod")
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)


def test_another_resnet_trains_with_the_personal_loss_reaching_the_body(pft_files, tmp_path):
    assert FedRoD.defaults["detach_personal"] is True
    res = scratch_run(pft_files, tmp_path / "r18", "fedrod", arch="resnet_mini_18", rounds=1, detach_personal=False)
    assert all(math.isfinite(v) for v in res.metrics["value"])
