"""FedHE (fedcore/methods/fedhe.py): the KD loss and the per-class logit aggregation against formulas written out,
what is sent (per-class means and counts, n_c(n_c+1) numbers), a 2-round heterogeneous-ResNet run with exact
resume, and the paper-scale parameter counts (Tables 2, 7, 9)."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch.nn import functional as F

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.roles import FitResult, RoundInfo, payload_numbers
from fedcore.methods.base import kd_loss
from fedcore.methods.fedhe import FedHE, FedHEServer, aggregate_logits, class_means
from fedcore.train import train_run

C = 4  # classes of the synthetic bundle
ARCHS = ("resnet_mini_18", "resnet_mini_34", "resnet_mini_50")
EVAL = {"global_test": "official_test", "per_class": True}


def test_loss_is_ce_plus_gamma_kl_towards_the_class_logit_and_matches_fd_at_t1():
    g = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(6, C, generator=g) * 2, torch.randn(C, C, generator=g) * 2
    labels, mask, t, gamma = torch.tensor([0, 1, 2, 3, 2, 0]), torch.tensor([1.0, 1.0, 0.0, 1.0]), 3.0, 0.7
    q, s = F.softmax(teacher[labels] / t, 1), F.softmax(logits / t, 1)
    kl = (q * (q.log() - s.log())).sum(1) * mask[labels]                 # class 2 has no global logit
    got = kd_loss(logits, labels, teacher, mask, gamma, t)
    assert torch.allclose(got, F.cross_entropy(logits, labels) + gamma * kl.sum() / 6, atol=1e-6)
    assert torch.equal(kd_loss(logits, labels, teacher, torch.zeros(C), 1.0, t), F.cross_entropy(logits, labels))
    # T = 1, every class present: the gradient of HtFLlib FD's CE(p, softmax(p̃_y)) (λ = 1)
    p = logits.clone().requires_grad_(True)
    kd_loss(p, labels, teacher, torch.ones(C), 1.0, 1.0).backward()
    fd = logits.clone().requires_grad_(True)
    (F.cross_entropy(fd, labels) + F.cross_entropy(fd, F.softmax(teacher[labels], 1))).backward()
    assert torch.allclose(p.grad, fd.grad, atol=1e-6)


def _uploads() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three clients' logits: client 1 has no class 0, nobody has class 3."""
    g = torch.Generator().manual_seed(1)
    out = []
    for n, classes in ((9, [0, 1, 2]), (5, [1, 2]), (12, [0, 1, 2])):
        out.append((torch.randn(n, C, generator=g) * 3, torch.tensor(classes)[torch.randint(len(classes), (n,),
                                                                                             generator=g)]))
    return out


def test_global_logits_are_the_mean_over_clients_or_over_samples():
    local = _uploads()
    means, counts = zip(*(class_means(x, y, C) for x, y in local))
    for (x, y), m, n in zip(local, means, counts):
        for c in range(C):
            assert n[c] == (y == c).sum()
            assert torch.allclose(m[c], x[y == c].mean(0) if n[c] else torch.zeros(C), atol=1e-6)
    by_client, mask = aggregate_logits(torch.stack(means), torch.stack(counts), "clients")
    by_sample, _ = aggregate_logits(torch.stack(means), torch.stack(counts), "samples")
    assert torch.equal(mask, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    for c in range(3):
        holders = [x[y == c].mean(0) for x, y in local if (y == c).any()]
        assert torch.allclose(by_client[c], torch.stack(holders).mean(0), atol=1e-5)        # HtFLlib FD
        pooled = torch.cat([x[y == c] for x, y in local])
        assert torch.allclose(by_sample[c], pooled.mean(0), atol=1e-5)                      # every class-c logit
    assert torch.equal(by_client[3], torch.zeros(C)) and not torch.allclose(by_client[0], by_sample[0])


def _method(**params) -> FedHE:
    torch.manual_seed(0)
    return FedHE([prompt_adapter(build_backbone(a)) for a in ARCHS[:2]], C, params, client_backbones=[0, 1, 0])


def test_server_sends_every_client_the_same_global_logits_and_counts_what_was_sent():
    server = _method().strategy
    local = _uploads()
    results = [FitResult(j, len(y), dict(zip(("logits", "counts"), class_means(x, y, C))), {})
               for j, (x, y) in enumerate(local)]
    state = server.aggregate(RoundInfo(1, 3, 1.0, 0), server.init_state(3), results)
    assert set(state) == {"logits", "mask"}                                  # logits and counts: no model tensor
    assert [payload_numbers(r.uplink) for r in results] == [C * (C + 1)] * 3   # n_c (n_c + 1)
    downs = [server.configure(state, k)["model"] for k in range(3)]
    assert all(set(d) == {"teacher", "teacher_mask"} and torch.equal(d["teacher"], downs[0]["teacher"]) for d in downs)


@pytest.mark.parametrize("classes, numbers", [(10, 110), (100, 10100)])
def test_upload_size_is_table_9s(classes, numbers):
    g = torch.Generator().manual_seed(2)
    means, counts = class_means(torch.randn(50, classes, generator=g), torch.randint(classes, (50,), generator=g),
                                classes)
    assert means.numel() + counts.numel() == numbers


def _run(files, out, stop=None, **method_params):
    out.mkdir(exist_ok=True)
    params = {**run_params(rounds=2, participation=1.0), "method_params": {"init": "random", **method_params},
              "client_backbones": [0, 1, 2, 1, 0], "evaluation": EVAL}
    return train_run(params, identity("fedhe"), files["dataset"], files["partition5"], list(ARCHS),
                     [files["weights"][a] for a in ARCHS], out / "m.parquet", out / "f.pt",
                     checkpoint_path=out / "ckpt.pt", progress=False, stop_after_round=stop)


def test_heterogeneous_resnets_exchange_only_class_logits_and_resume_exactly(hetero_files, tmp_path, monkeypatch):
    uplinks = []
    original = FedHEServer.aggregate
    monkeypatch.setattr(FedHEServer, "aggregate", lambda self, info, state, results: uplinks.extend(
        {k: tuple(v.shape) for k, v in r.uplink.items()} for r in results) or original(self, info, state, results))
    full = _run(hetero_files, tmp_path / "full")
    assert uplinks == [{"logits": (C, C), "counts": (C,)}] * 10
    assert full.global_state == {} and full.server_state["mask"].sum() == C
    for c, dim in enumerate([128, 128, 512, 128, 128]):
        state = full.personal_states[c]
        assert state["head.weight"].shape == (C, dim) and "teacher" not in state
        assert "net.bn1.running_mean" in state and "net.conv1.weight" in state      # the whole model stays
    m = full.metrics
    last = m[(m["round"] == 2) & (m.split == "global")]
    acc = last[(last.metric == "acc") & (last.client >= 0)]["value"]
    assert len(acc) == 5 and acc.between(0, 1).all()
    assert last[(last.metric == "acc") & (last.client == -1)]["value"].item() == pytest.approx(acc.mean())
    sent = m[m.metric == "upload_numbers"]["value"]
    assert len(sent) == 10 and (sent == C * (C + 1)).all()                  # n_c (n_c + 1), every client, every round
    losses = m[(m.metric == "loss") & (m.client >= 0)]["value"]
    assert losses.notna().all() and (losses > 0).all()
    assert _run(hetero_files, tmp_path / "cut", stop=1) is None
    resumed = _run(hetero_files, tmp_path / "cut")
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
    for c, state in full.client_states.items():
        for k, v in state["model"].items():
            assert torch.equal(v, resumed.client_states[c]["model"][k]), (c, k)
    plain = _run(hetero_files, tmp_path / "gamma0", gamma=0.0)              # γ = 0: CE only
    acc = lambda r, k: r.metrics[(r.metrics["round"] == k) & (r.metrics.metric == "acc")]["value"].to_numpy()  # noqa
    assert (acc(plain, 1) == acc(full, 1)).all()                            # round 1: no global logits yet
    assert not torch.equal(plain.personal_states[2]["head.weight"], full.personal_states[2]["head.weight"])


# ---- paper scale (meta device): Table 7's FedHE row, Table 2's sum, Table 9's upload ----------------------
def _paper(classes: int) -> FedHE:
    with torch.device("meta"):
        return FedHE([prompt_adapter(build_backbone(a)) for a in ("resnet18", "resnet34", "resnet50")], classes,
                     {"init": "random"}, [0, 1, 2, 1, 0])


def _trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


STEM = 7 * 7 * 3 * 64 - 3 * 3 * 3 * 64   # torchvision's 7x7 stem minus a CIFAR-style 3x3 one


def test_paper_parameter_counts():
    for classes, table7 in ((10, [10.656, 20.296, 22.431]), (100, [10.700, 20.340, 22.607])):
        method = _paper(classes)
        ours = [_trainable(m) for m in method.models]
        assert ours == [b + d * classes + classes for b, d in ((11_176_512, 512), (21_284_672, 512),
                                                               (23_508_032, 2048))]
        # the paper's FedHE row is exactly these models with a 3x3 stem instead of torchvision's 7x7
        assert [round((n - STEM) / 2**20, 3) for n in ours] == table7
        assert [round(n / 2**20, 3) for n in ours] != table7
    assert round(2 * 10.656 + 2 * 20.296 + 22.431, 3) == 84.335            # Table 2 sums Table 7's rounded values
