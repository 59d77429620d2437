"""FedMD (fedcore/methods/fedmd.py): the consensus is the mean of the uploaded public logits, the digest fits it
(mean absolute error), the phases run transfer learning -> revisit in round 1 and digest -> revisit after, only
public logits leave a client ((n_c + n_p + 1)·|D_p| numbers), the public dataset reaches the method through
train_run's extra datasets, a 2-round heterogeneous-ResNet run resumes exactly, and the paper-scale counts."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.constraints import violations
from fedcore.data.arrays import ArrayDataset, DatasetBundle, save_bundle
from fedcore.data.embedded import build_embedded
from fedcore.engine.data import DeviceSplit, InputPipeline
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import ExtraData, FitResult, RoundInfo, payload_numbers
from fedcore.methods.fedmd import FedMD, FedMDClient, FedMDServer, consensus_of, digest_loss
from fedcore.train import train_run

C, P = 4, 10   # private classes of the synthetic bundle, public classes of digits_public
ARCHS = ("resnet_mini_18", "resnet_mini_34", "resnet_mini_50")
EVAL = {"global_test": "official_test", "per_class": True}
BASE = {"init": "random", "public": "digits_public", "pretrain_epochs": 1}


@pytest.fixture(scope="module")
def public_file(tmp_path_factory):
    """80 of the public digits (every class), saved as a bundle: small enough for a test run."""
    pub = build_embedded("digits_public")
    keep = lambda ds: ArrayDataset(ds.x[:80], ds.y[:80])  # noqa: E731
    path = tmp_path_factory.mktemp("public") / "public.npz"
    save_bundle(DatasetBundle(train=keep(pub.train), test=keep(pub.test), meta=pub.meta), path)
    return path


def test_digest_loss_and_consensus_are_the_formulas():
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(5, C + P, generator=g), torch.randn(5, C + P, generator=g)
    literal = sum(abs(float(logits[i, j] - target[i, j])) for i in range(5) for j in range(C + P)) / (5 * (C + P))
    assert digest_loss(logits, target).item() == pytest.approx(literal, rel=1e-6)
    ups = [torch.randn(6, C + P, generator=g) for _ in range(3)]
    assert torch.allclose(consensus_of(ups), (ups[0] + ups[1] + ups[2]) / 3, atol=1e-6)


def _method(public_subset=None, **params) -> FedMD:
    torch.manual_seed(0)
    m = FedMD([prompt_adapter(build_backbone(a)) for a in ARCHS[:2]], C,
              {**BASE, "public_subset": public_subset, **params}, client_backbones=[0, 1, 0])
    pub = build_embedded("digits_public").train
    m.attach_dataset("public", ExtraData(DeviceSplit.from_arrays(pub, torch.device("cpu")), 10,
                                         InputPipeline(16, (0.5,) * 3, (0.5,) * 3)))
    return m


def test_server_draws_a_seeded_subset_and_averages_the_uploads_on_it():
    server = _method(public_subset=32).strategy
    state = server.init_state(3)
    info = RoundInfo(2, 3, 1.0, 7)
    assert server.select(info, state) == [0, 1, 2]
    idx = state["upload_index"]
    assert len(idx) == 32 and len(set(idx.tolist())) == 32 and torch.equal(idx, idx.sort().values)
    assert torch.equal(idx, server.subset(info)) and not torch.equal(idx, server.subset(RoundInfo(3, 3, 1.0, 7)))
    g = torch.Generator().manual_seed(1)
    ups = [torch.randn(32, C + P, generator=g) for _ in range(3)]
    results = [FitResult(k, 10, {"logits": u, "index": idx}, {}) for k, u in enumerate(ups)]
    new = server.aggregate(info, state, results)
    assert torch.allclose(new["consensus"], torch.stack(ups).mean(0), atol=1e-6)
    assert torch.equal(new["consensus_index"], idx)
    assert [payload_numbers(r.uplink) for r in results] == [32 * (C + P + 1)] * 3   # (n_c + n_p + 1)·|D_p|
    down = server.configure(new, 1)
    assert set(down) == {"consensus", "consensus_index", "upload_index"}
    bad = [FitResult(0, 10, {"logits": ups[0], "index": idx + 1}, {})]
    with pytest.raises(RuntimeError, match="client 0 uploaded logits on other public rows"):
        server.aggregate(info, state, bad)
    assert torch.equal(_method().strategy.subset(info), torch.arange(540))  # public_subset null: every row


def test_a_public_pass_skips_a_last_batch_of_one_sample_when_the_model_trains_batchnorm():
    method = _method()
    model = method.model_for(0).train()
    named = dict(model.named_parameters())
    params = [named[k] for k in method.trainable_keys(0)]
    rows = torch.arange(17)                                              # 16 + 1 at batch size 16
    downlink = {"consensus": torch.zeros(17, C + P), "consensus_index": rows}
    data = ClientData(0, 17, lambda: iter(()), torch.Generator().manual_seed(0))
    settings = TrainSettings(1, 16, {"name": "sgd", "lr": 0.01})
    seen = []
    original = model.forward
    model.forward = lambda x: (seen.append(len(x)), original(x))[1]     # type: ignore[method-assign]
    loss = method.client.digest(model, params, downlink, data, settings)  # torch raised on the batch of one
    assert seen == [16] and loss == loss


@pytest.mark.parametrize("classes, per_sample", [(10, 21), (100, 111)])
def test_table_9_upload_size(classes, per_sample):
    assert classes + P + 1 == per_sample   # logits of n_c + n_p outputs and the row id, per public sample


def test_params_are_checked_before_any_work():
    from fedcore.constraints import RunFacts

    assert [v.key for v in violations(FedMD.param_rules, dict(FedMD.defaults), None)] == ["public"]
    facts = RunFacts((), "digits", 10, 5)
    bad = violations(FedMD.param_rules, {**FedMD.defaults, "public": "digits"}, facts)
    assert [str(v) for v in bad] == ["key 'public' = 'digits': allowed a dataset other than the run's own (digits)"]
    assert violations(FedMD.param_rules, {**FedMD.defaults, "public": "digits_public"}, facts) == []
    with pytest.raises(ValueError, match="key 'public_classes' = 5: the public dataset digits_public has 10"):
        FedMD.check_params({**FedMD.defaults, "public": "digits_public", "public_classes": 5})
    with pytest.raises(ValueError, match="key 'public_subset' = 600: the public dataset digits_public has only 540"):
        FedMD.check_params({**FedMD.defaults, "public": "digits_public", "public_subset": 600})
    with pytest.raises(ValueError, match="'public_classes' = 100, but the public dataset cifar100 has 10 classes"):
        _method(public="cifar100", public_classes=100)                    # the bundle is not what was named


def _run(files, public, out, stop=None, extra="default", **method_params):
    out.mkdir(exist_ok=True)
    params = {**run_params(rounds=2, participation=1.0), "method_params": {**BASE, **method_params},
              "client_backbones": [0, 1, 2, 1, 0], "evaluation": EVAL}
    return train_run(params, identity("fedmd"), files["dataset"], files["partition5"], list(ARCHS),
                     [files["weights"][a] for a in ARCHS], out / "m.parquet", out / "f.pt",
                     checkpoint_path=out / "ckpt.pt", progress=False, stop_after_round=stop,
                     extra_datasets={"public": public} if extra == "default" else extra)


def test_train_run_hands_over_the_declared_public_dataset_only(hetero_files, public_file, tmp_path):
    with pytest.raises(ValueError, match=r"reads the extra dataset\(s\) public \(digits_public\); no file"):
        _run(hetero_files, public_file, tmp_path / "a", extra=None)
    with pytest.raises(ValueError, match=r"extra dataset\(s\) \['other'\] were given"):
        _run(hetero_files, public_file, tmp_path / "b", extra={"public": public_file, "other": public_file})


def test_phases_digest_then_revisit_and_only_public_logits_leave(hetero_files, public_file, tmp_path, monkeypatch):
    calls, uplinks, consensus, digested = [], [], [], []
    for phase in ("pretrain", "digest", "revisit"):
        original = getattr(FedMDClient, phase)

        def spy(self, model, params, *args, _phase=phase, _original=original):
            calls.append((_phase, args[-2].cid))                              # args end with (data, settings)
            if _phase == "digest":
                digested.append(args[0]["consensus"].clone())
            return _original(self, model, params, *args)
        monkeypatch.setattr(FedMDClient, phase, spy)
    aggregate = FedMDServer.aggregate

    def agg(self, info, state, results):
        uplinks.extend({k: tuple(v.shape) for k, v in r.uplink.items()} for r in results)
        new = aggregate(self, info, state, results)
        consensus.append(new["consensus"].clone())
        return new
    monkeypatch.setattr(FedMDServer, "aggregate", agg)

    full = _run(hetero_files, public_file, tmp_path / "full", public_subset=48)
    assert [p for p, c in calls if c == 0] == ["pretrain", "revisit", "digest", "revisit"]
    assert [c for p, c in calls if p == "pretrain"] == list(range(5)) and len(calls) == 5 * 4
    assert all(torch.equal(d, consensus[0]) for d in digested) and len(digested) == 5   # round 1's consensus
    assert uplinks == [{"logits": (48, C + P), "index": (48,)}] * 10
    assert full.global_state == {} and full.server_state["consensus"].shape == (48, C + P)
    for c, dim in enumerate([128, 128, 512, 128, 128]):
        state = full.client_states[c]
        assert state["transferred"] is True and state["model"]["head.weight"].shape == (C + P, dim)
    m = full.metrics
    sent = m[m.metric == "upload_numbers"]["value"]
    assert len(sent) == 10 and (sent == 48 * (C + P + 1)).all()
    last = m[(m["round"] == 2) & (m.split == "global") & (m.metric == "acc")]
    assert len(last) == 6 and last["value"].between(0, 1).all()
    classes = m[(m["round"] == 2) & (m.client == -1) & m.metric.str.startswith("acc_class")]
    assert sorted(classes.metric) == [f"acc_class{k}" for k in range(C)]
    monkeypatch.undo()
    assert _run(hetero_files, public_file, tmp_path / "cut", stop=1, public_subset=48) is None
    resumed = _run(hetero_files, public_file, tmp_path / "cut", public_subset=48)
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
    for c, state in full.client_states.items():
        for k, v in state["model"].items():
            assert torch.equal(v, resumed.client_states[c]["model"][k]), (c, k)


# ---- paper scale (meta device): Table 7's FedMD row and Table 2's sum ---------------------------------------
STEM = 7 * 7 * 3 * 64 - 3 * 3 * 3 * 64   # torchvision's 7x7 stem minus a CIFAR-style 3x3 one


def test_paper_parameter_counts():
    for classes, table7 in ((10, [10.661, 20.301, 22.451]), (100, [10.705, 20.345, 22.627])):
        with torch.device("meta"):
            method = FedMD([prompt_adapter(build_backbone(a)) for a in ("resnet18", "resnet34", "resnet50")],
                           classes, {"init": "random", "public": "svhn"}, [0, 1, 2, 1, 0])
        ours = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in method.models]
        out = classes + P
        assert ours == [b + d * out + out for b, d in ((11_176_512, 512), (21_284_672, 512), (23_508_032, 2048))]
        assert [round((n - STEM) / 2**20, 3) for n in ours] == table7   # the paper's models have a 3x3 stem
    assert round(2 * 10.661 + 2 * 20.301 + 22.451, 3) == 84.375          # Table 2 sums Table 7's rounded values
