"""FedHPL (spec fedhpl §9): β matrices, Eq. 8 from "All" and "Average" uploads, uniform β, the loss, round 1 and
γ = 0 against Local, heterogeneous ViT and ResNet runs (with resume), the paper's trainable-parameter counts, and
the +P / +H policies (Table 3(e): prompts or head averaged within groups of the same shapes)."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch.nn import functional as F

import fedcore.engine.loop as loop
from conftest import identity, run_params, synthetic_bundle
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.roles import FitResult, RoundInfo
from fedcore.methods.base import kd_loss
from fedcore.methods.fedhpl import (SHARED, FedHPL, FedHPLClient, FedHPLServer, beta_matrix, class_sums,
                                    global_logits, upload_all, upload_average)
from fedcore.train import train_run

C = 4  # classes of the synthetic bundle
SERVER_KEYS = {"logits", "mask", "counts", "uploaded"}


# ---- server algebra --------------------------------------------------------------------------------
def test_beta_matrices_of_the_paper_settings():
    hetvit = beta_matrix([384, 768, 1024, 768, 384])  # spec §1.6, row k = receiving client
    s, b, l_ = [1.0, 0.5, 0.375, 0.5, 1.0], [0.5, 1.0, 0.75, 1.0, 0.5], [0.375, 0.75, 1.0, 0.75, 0.375]
    assert torch.equal(hetvit, torch.tensor([s, b, l_, b, s], dtype=torch.float64))
    hetres = beta_matrix([512, 512, 2048, 512, 512])
    expected = torch.ones(5, 5, dtype=torch.float64)
    expected[2, :] = expected[:, 2] = 0.25
    expected[2, 2] = 1.0
    assert torch.equal(hetres, expected)
    assert torch.equal(beta_matrix([768] * 5), torch.ones(5, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="positive"):
        beta_matrix([384, 0])


def _local_logits(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three clients' kept logits: client 1 has no class-0 logit, and no client has one of class 3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, classes in ((9, [0, 1, 2]), (7, [1, 2]), (12, [0, 1, 2])):
        labels = torch.tensor(classes)[torch.randint(len(classes), (n,), generator=g)]
        out.append((torch.randn(n, C, generator=g) * 3, labels))
    return out


def _eq8_literal(local: list[tuple[torch.Tensor, torch.Tensor]], beta: torch.Tensor) -> torch.Tensor:
    """Eq. 8 written out with loops over clients, classes and samples."""
    out = torch.zeros(len(beta), C, C, dtype=torch.float64)
    for k in range(len(beta)):
        for c in range(C):
            num, den = torch.zeros(C, dtype=torch.float64), 1.0
            for j, (logits, labels) in enumerate(local):
                for p, y in zip(logits.double(), labels.tolist()):
                    if y == c:
                        num += beta[k, j] * p
                        den += float(beta[k, j])
            out[k, c] = num / den
    return out


def test_eq8_from_all_and_from_average_uploads_equals_the_literal_formula():
    local = _local_logits()
    beta = beta_matrix([32, 80, 32])
    got = {}
    for kind in ("All", "Average"):
        uplinks = [upload_all(x, y) if kind == "All" else upload_average(x, y, C) for x, y in local]
        sums, counts = zip(*(class_sums(u, C) for u in uplinks))
        got[kind], mask = global_logits(torch.stack(sums), torch.stack(counts), beta)
        assert torch.equal(mask, torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 3, dtype=torch.float64))
    ref = _eq8_literal(local, beta)
    assert torch.allclose(got["All"], ref, rtol=0, atol=1e-12)
    assert torch.allclose(got["Average"], got["All"], rtol=1e-6, atol=1e-6)   # the means travel in float32
    rows = got["All"][:, :3].reshape(-1, C)                                  # classes with a teacher
    assert (F.cosine_similarity(got["Average"][:, :3].reshape(-1, C), rows) > 1 - 1e-6).all()
    assert torch.equal(got["All"][0], got["All"][2]) and not torch.allclose(got["All"][0], got["All"][1])
    assert torch.equal(got["All"][:, 3], torch.zeros(3, C, dtype=torch.float64))  # no upload: p̃ = 0, masked


def test_upload_sizes_are_the_papers():
    logits, labels = _local_logits()[0]
    assert sum(t.numel() for t in upload_all(logits, labels).values()) == len(labels) * (C + 1)   # |D̃_k|(n_c+1)
    assert sum(t.numel() for t in upload_average(logits, labels, C).values()) == C * (C + 1)       # n_c(n_c+1)


def _tiny_method(**params) -> FedHPL:
    """FedHPL around random-weight vit_mini_s (dim 32) and vit_mini (dim 64): clients 0 | 1, 2."""
    torch.manual_seed(0)
    backbones = [prompt_adapter(build_backbone(a)) for a in ("vit_mini_s", "vit_mini")]
    return FedHPL(backbones, C, params, client_backbones=[0, 1, 1])


def test_uniform_beta_gives_every_client_the_plain_average():
    local = _local_logits(1)
    results = [FitResult(j, 20, upload_all(x, y), {}) for j, (x, y) in enumerate(local)]
    info = RoundInfo(1, 3, 1.0, 0)
    uniform = _tiny_method(beta="uniform").strategy
    state = uniform.aggregate(info, uniform.init_state(3), results)
    assert set(state) == SERVER_KEYS                                    # logits and counts: no model tensor
    labels = torch.cat([y for _, y in local])
    logits = torch.cat([x for x, _ in local]).double()
    for c in range(C):   # Σ of every class-c logit / (1 + their number), the same for each client
        plain = logits[labels == c].sum(0) / (1 + int((labels == c).sum()))
        for k in range(3):
            assert torch.allclose(state["logits"][k, c].double(), plain, atol=1e-6)
    dims = _tiny_method().strategy
    weighted = dims.aggregate(info, dims.init_state(3), results)["logits"]
    assert torch.equal(weighted[1], weighted[2]) and not torch.allclose(weighted[0], weighted[1])
    down = dims.configure({**state, "logits": weighted}, 2)["model"]
    assert torch.equal(down["teacher"], weighted[2]) and set(down) == {"teacher", "teacher_mask"}


def test_upload_keeps_the_correct_predictions_or_every_sample():
    from fedcore.engine.data import Batch
    from fedcore.engine.optim import ClientData

    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(40, 3, 16, 16, generator=g), torch.randint(C, (40,), generator=g)
    data = ClientData(0, 40, lambda: iter([Batch(x[:25], y[:25], torch.arange(25), {}),
                                           Batch(x[25:], y[25:], torch.arange(25, 40), {})]), g)
    for correct_only in (True, False):
        method = _tiny_method(upload_correct_only=correct_only)
        model = method.model_for(0)
        with torch.no_grad():
            pred = model(x).argmax(1)
        up = method.client.upload(model, 0, data, {})
        if correct_only:
            assert 0 < len(up["labels"]) < 40 and torch.equal(up["labels"], y[pred == y])
            assert torch.equal(up["logits"].argmax(1), up["labels"])
        else:
            assert torch.equal(up["labels"], y)                          # Fig. 3(c): every sample


# ---- the loss --------------------------------------------------------------------------------------
def test_loss_is_ce_plus_gamma_kl_from_teacher_to_student_without_t_squared():
    g = torch.Generator().manual_seed(3)
    logits, teacher = torch.randn(6, C, generator=g) * 2, torch.randn(C, C, generator=g) * 2
    labels, mask, t, gamma = torch.tensor([0, 1, 2, 3, 2, 0]), torch.tensor([1.0, 1.0, 0.0, 1.0]), 4.5, 0.7
    q, s = F.softmax(teacher[labels] / t, 1), F.softmax(logits / t, 1)
    kl = (q * (q.log() - s.log())).sum(1) * mask[labels]                 # Eq. 9, class 2 has no teacher
    got = kd_loss(logits, labels, teacher, mask, gamma, t)
    assert torch.allclose(got, F.cross_entropy(logits, labels) + gamma * kl.sum() / 6, atol=1e-6)
    reverse = (s * (s.log() - q.log())).sum(1) * mask[labels]
    assert not torch.allclose(got, F.cross_entropy(logits, labels) + gamma * reverse.sum() / 6, atol=1e-4)
    no_teacher = kd_loss(logits, labels, teacher, torch.zeros(C), 1.0, t)
    assert torch.equal(no_teacher, F.cross_entropy(logits, labels))   # round 1: exactly CE


@pytest.mark.parametrize("key, value", [("prompt_depth", "middle"), ("num_prompts", 0), ("num_prompts", 2.5),
                                        ("pad_width", True), ("temperature", 0), ("gamma", -0.1),
                                        ("upload", "all"), ("beta", "cosine"), ("keep_optimizer", "yes"),
                                        ("upload_correct_only", 1), ("share", "prompt"), ("share", None)])
def test_bad_params_are_refused_naming_the_key(key, value):
    from fedcore.constraints import violations

    bad = violations(FedHPL.param_rules, {**FedHPL.defaults, key: value}, None)
    assert [v.key for v in bad] == [key] and f"key '{key}'" in str(bad[0])
    assert violations(FedHPL.param_rules, dict(FedHPL.defaults), None) == []


# ---- runs ------------------------------------------------------------------------------------------
def _run(files, out, method="fedhpl", rounds=2, stop=None, archs="vit_mini", weights=None, partition=None,
         client_backbones=None, evaluation=None, **method_params):
    out.mkdir(exist_ok=True)
    params = {**run_params(rounds=rounds, participation=1.0), "method_params": method_params}
    if client_backbones is not None:
        params["client_backbones"] = client_backbones
    if evaluation is not None:
        params["evaluation"] = evaluation
    return train_run(params, identity(method), files["dataset"], partition or files["partition"], archs,
                     weights or files["weights"], out / "m.parquet", out / "f.pt", checkpoint_path=out / "ckpt.pt",
                     progress=False, stop_after_round=stop, device="cpu")  # the bit-equality claims are CPU ones


def test_round_one_is_ce_only_and_later_rounds_distil(tiny_run_files, tmp_path):
    after = {}
    for gamma in (0.0, 1.0):
        out = tmp_path / f"g{gamma}"
        assert _run(tiny_run_files, out, stop=1, gamma=gamma) is None
        round1 = torch.load(out / "ckpt.pt", weights_only=False)["clients"]
        after[gamma] = (round1, _run(tiny_run_files, out, gamma=gamma).client_states)
    for c in range(4):
        for k, v in after[0.0][0][c]["model"].items():
            assert torch.equal(v, after[1.0][0][c]["model"][k]), (c, k)   # round 1: KD has nothing to act on
    final0, final1 = after[0.0][1][0]["model"], after[1.0][1][0]["model"]
    assert not torch.equal(final0["head.weight"], final1["head.weight"])  # round 2: the teacher acts


def test_gamma_zero_equals_local(tiny_run_files, tmp_path):
    """Local (VPT-shallow, 1 token, fresh optimiser per round) is FedHPL with γ = 0 at the same model and
    optimiser settings: identical client states and accuracies, bit for bit (both train their clients together)."""
    local = _run(tiny_run_files, tmp_path / "local", method="local")
    hpl = _run(tiny_run_files, tmp_path / "hpl", gamma=0.0, prompt_depth="shallow", num_prompts=1,
               keep_optimizer=False)
    assert set(local.personal_states) == set(hpl.personal_states) == {0, 1, 2, 3}
    for c, state in local.personal_states.items():
        assert state.keys() == hpl.personal_states[c].keys()
        for k, v in state.items():
            assert torch.equal(v, hpl.personal_states[c][k]), (c, k)
    acc = lambda m: m[m.metric.str.startswith("acc")].reset_index(drop=True)[["round", "client", "split", "metric",
                                                                              "value"]]  # noqa: E731
    pd.testing.assert_frame_equal(acc(local.metrics), acc(hpl.metrics))


def test_clients_trained_together_equal_one_by_one_with_teachers(tiny_run_files, tmp_path, monkeypatch):
    together = _run(tiny_run_files, tmp_path / "a", keep_optimizer=False)
    monkeypatch.setattr(loop, "_why_not_together", lambda method: "forced one by one")
    alone = _run(tiny_run_files, tmp_path / "b", keep_optimizer=False)
    assert together.server_state["mask"].sum() > 0                      # round 2 distilled
    for c, state in together.personal_states.items():
        for k, v in state.items():
            assert torch.allclose(v, alone.personal_states[c][k], atol=1e-5), (c, k)
    a, b = together.metrics, alone.metrics
    assert abs(a["value"].to_numpy() - b["value"].to_numpy()).max() < 1e-4


EVAL = {"global_test": "official_test", "per_class": True}


def _hetero(files, out, archs, stop=None, **method_params):
    return _run(files, out, stop=stop, archs=list(archs), weights=[files["weights"][a] for a in archs],
                partition=files["partition5"], client_backbones=[0, 1, 2, 1, 0], evaluation=EVAL, **method_params)


def _check_rows(m: pd.DataFrame, clients: int = 5, rounds: int = 2) -> None:
    """Per client accuracy on the full test set (mean/min/max), per class, and the upload counts every round."""
    last = m[m["round"] == rounds]
    per_client = last[(last.split == "global") & (last.metric == "acc") & (last.client >= 0)]
    assert sorted(per_client.client) == list(range(clients))
    mean = last[(last.client == -1) & (last.split == "global") & (last.metric == "acc")]["value"].item()
    assert abs(mean - per_client["value"].mean()) < 1e-12
    for c in [-1, *range(clients)]:
        classes = last[(last.client == c) & last.metric.str.startswith("acc_class")]
        assert sorted(classes.metric) == sorted(f"acc_class{k}" for k in range(C))
        assert classes["value"].between(0, 1).all()
    ups = m[m.metric == "upload_count"]
    assert len(ups) == clients * rounds
    by_class = m[m.metric.str.startswith("upload_count_class")].groupby(["round", "client"])["value"].sum()
    assert (ups.set_index(["round", "client"])["value"] == by_class).all()


def test_heterogeneous_vits_exchange_only_logits_and_resume_exactly(hetero_files, tmp_path, monkeypatch):
    uplinks = []
    original = FedHPLServer.aggregate
    monkeypatch.setattr(FedHPLServer, "aggregate", lambda self, info, state, results: uplinks.extend(
        set(r.uplink) for r in results) or original(self, info, state, results))
    archs = ("vit_mini_s", "vit_mini", "vit_mini_l")                     # dims 32, 64, 80; depths 4, 4, 6
    full = _hetero(hetero_files, tmp_path / "full", archs)
    assert uplinks and all(keys == {"logits", "labels"} for keys in uplinks)
    assert set(full.server_state) == SERVER_KEYS and full.global_state == {}
    teacher = full.server_state["logits"]
    assert full.server_state["mask"].sum() > 0 and teacher.shape == (5, C, C)
    assert torch.equal(teacher[0], teacher[4]) and torch.equal(teacher[1], teacher[3])  # same dim, same p̃
    assert not torch.allclose(teacher[0], teacher[2])
    for c, (dim, depth) in enumerate([(32, 4), (64, 4), (80, 6), (64, 4), (32, 4)]):
        state = full.personal_states[c]
        assert state["head.weight"].shape == (C, dim) and "teacher" not in state
        assert sorted(k for k in state if k.startswith("prompts.")) == sorted(f"prompts.{i}" for i in range(depth))
        assert full.client_states[c]["optimizer"]["state"]                 # kept across rounds (default)
    m = full.metrics
    _check_rows(m)
    ups = m[m.metric == "upload_count"].set_index(["round", "client"])["value"]
    sent = m[m.metric == "upload_numbers"].set_index(["round", "client"])["value"]
    assert (sent == ups * (C + 1)).all()                                 # "All": |D̃_k|(n_c + 1)
    assert _hetero(hetero_files, tmp_path / "cut", archs, stop=1) is None
    resumed = _hetero(hetero_files, tmp_path / "cut", archs)
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
    for c, state in full.client_states.items():
        for k, v in state["model"].items():
            assert torch.equal(v, resumed.client_states[c]["model"][k]), (c, k)


def test_heterogeneous_resnets_train_pad_prompts_and_heads(hetero_files, tmp_path):
    archs = ("resnet_mini_18", "resnet_mini_34", "resnet_mini_50")       # dims 128, 128, 512
    res = _hetero(hetero_files, tmp_path, archs, upload="Average")
    for c, dim in enumerate([128, 128, 512, 128, 128]):
        state = res.personal_states[c]
        assert sorted(state) == ["head.bias", "head.weight", "pad.prompt_lr", "pad.prompt_tb"]
        assert state["head.weight"].shape == (C, dim) and state["pad.prompt_lr"].abs().sum() > 0
    teacher = res.server_state["logits"]
    assert torch.equal(teacher[0], teacher[1]) and not torch.allclose(teacher[0], teacher[2])
    m = res.metrics
    _check_rows(m)
    assert (m[m.metric == "upload_numbers"]["value"] == C * (C + 1)).all()  # "Average": n_c(n_c + 1)


# ---- trainable parameters at paper scale (spec §9; Tables 1, 2, 6, 8) --------------------------------
def _count(module: torch.nn.Module, trainable: bool = True) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


def _paper_method(archs: tuple[str, ...], classes: int = 10, **params) -> FedHPL:
    with torch.device("meta"):   # architectures only: no weights, no memory
        return FedHPL([prompt_adapter(build_backbone(a)) for a in archs], classes, params, [0, 1, 2, 1, 0])


def test_trainable_parameters_match_the_papers_tables():
    vit = _paper_method(("vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224"))
    assert [_count(m.backbone, False) for m in vit.models] == [21_665_664, 85_798_656, 303_301_632]
    assert [_count(m) for m in vit.models] == [17_674, 35_338, 83_978]               # Table 6, deep n = 3
    assert round(35_338 / 2**20, 3) == 0.034                                        # Table 1 Param (M)
    assert round(sum(_count(vit.model_for(k)) for k in range(5)) / 2**20, 3) == 0.181  # Table 2, FedHPL (ViT)
    shallow = _paper_method(("vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224"), 100,
                            prompt_depth="shallow", num_prompts=5)
    assert [_count(m) for m in shallow.models] == [5 * d + 100 * d + 100 for d in (384, 768, 1024)]  # Table 6, C100
    resnet = _paper_method(("resnet18", "resnet34", "resnet50"))
    assert [_count(m.backbone, False) for m in resnet.models] == [11_176_512, 21_284_672, 23_508_032]
    assert [_count(m) for m in resnet.models] == [5130 + 8172, 5130 + 8172, 20490 + 8172]  # Table 8 @224
    assert [round(_count(m) / 1024, 2) for m in resnet.models] == [12.99, 12.99, 27.99]
    assert round(sum(_count(resnet.model_for(k)) for k in range(5)) / 2**20, 3) == 0.078  # Table 2, FedHPL (CNN)


# ---- +P / +H (Table 3(e), spec §1.9, §8.18) -----------------------------------------------------------
def _three_widths(**params) -> FedHPL:
    """FedHPL around random vit_mini_s / vit_mini / vit_mini_l (dims 32 / 64 / 80; depths 4 / 4 / 6): S B L B S."""
    torch.manual_seed(0)
    backbones = [prompt_adapter(build_backbone(a)) for a in ("vit_mini_s", "vit_mini", "vit_mini_l")]
    return FedHPL(backbones, C, params, client_backbones=[0, 1, 2, 1, 0])


@pytest.mark.parametrize("share, names", [("prompts", "prompts."), ("head", "head.")])
def test_group_average_is_sample_weighted_within_each_width_and_a_singleton_keeps_its_own(share, names):
    method = _three_widths(share=share)
    server, client = method.strategy, method.client
    g = torch.Generator().manual_seed(5)
    samples = [10, 30, 7, 50, 20]
    sent = [{k: torch.randn(v.shape, generator=g) for k, v in method.initial_state(
        c, client.shared_keys(method.keys(c))).items()} for c in range(5)]
    assert sent[0] and all(k.startswith(names) for k in sent[0])           # only the prompts, or only the head
    logits, labels = _local_logits(2)[0]
    results = [FitResult(c, samples[c], {**upload_all(logits, labels), "model": sent[c]}, {}) for c in range(5)]
    state = server.aggregate(RoundInfo(1, 5, 1.0, 0), server.init_state(5), results)
    assert len(state[SHARED]) == 3                                         # S, B, L: never across widths
    down = [server.configure(state, c)[SHARED] for c in range(5)]
    for group in ((0, 4), (1, 3)):                                         # Σ n_c x_c / Σ n_c, in the test's words
        total = sum(samples[c] for c in group)
        for k in sent[group[0]]:
            want = sum(samples[c] * sent[c][k].double() for c in group) / total
            for c in group:
                assert torch.allclose(down[c][k].double(), want, rtol=0, atol=1e-6), (c, k)
                assert not torch.allclose(down[c][k], sent[c][k])
    assert down[2].keys() == sent[2].keys() and all(torch.equal(down[2][k], sent[2][k]) for k in sent[2])
    # the average overwrites a client's copy after the round (§8.18): its next round and its evaluation see it
    own = {"model": {k: v + 1.0 for k, v in sent[0].items()}}
    model = method.model_for(0)
    method.evaluator.load(model, 0, state, own, None)
    assert all(torch.equal(model.get_parameter(k), down[0][k]) for k in own["model"])
    client.start(model, 0, own, server.configure(state, 0))
    assert all(torch.equal(model.get_parameter(k), down[0][k]) for k in own["model"])
    # only clients 1 and 2 take part: B's average is client 1's, L's too; S keeps the previous round's
    later = server.aggregate(RoundInfo(2, 5, 1.0, 0), state, [results[1], results[2]])
    assert all(torch.equal(server.configure(later, 3)[SHARED][k], sent[1][k]) for k in sent[1])
    assert all(torch.equal(server.configure(later, 4)[SHARED][k], down[4][k]) for k in sent[4])


def test_share_none_sends_and_receives_no_model_tensor():
    method = _three_widths()
    assert all(method.client.shared_keys(method.keys(c)) == [] for c in range(5))
    state = method.strategy.init_state(5)
    assert set(state) == SERVER_KEYS and set(method.strategy.configure(state, 0)) == {"model"}


def _spy_starts(monkeypatch) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Record each client's prompts and head as its local training begins (after the downlink was loaded); its
    clients train one by one (``train`` is the one-by-one update; clients trained together are compared elsewhere)."""
    starts: list[tuple[int, dict[str, torch.Tensor]]] = []
    original = FedHPLClient.train
    monkeypatch.setattr(loop, "_why_not_together", lambda method: "forced one by one")

    def train(self, model, cid, *args):
        starts.append((cid, {k: v.detach().clone() for k, v in model.state_dict().items()
                             if k.startswith(("prompts.", "head."))}))
        return original(self, model, cid, *args)
    monkeypatch.setattr(FedHPLClient, "train", train)
    return starts


def _spy_samples(monkeypatch) -> dict[int, int]:
    """Record each uploading client's sample count."""
    samples: dict[int, int] = {}
    original = FedHPLServer.aggregate
    monkeypatch.setattr(FedHPLServer, "aggregate", lambda self, info, state, results: samples.update(
        {r.cid: r.num_samples for r in results}) or original(self, info, state, results))
    return samples


def test_plus_p_homogeneous_clients_start_the_next_round_with_the_same_prompts(tiny_run_files, tmp_path,
                                                                                monkeypatch):
    samples = _spy_samples(monkeypatch)
    assert _run(tiny_run_files, tmp_path, stop=1, share="prompts") is None
    round1 = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    (average,) = round1["server"][SHARED].values()                          # one group: all four clients
    mine = {c: s["model"] for c, s in round1["clients"].items()}            # the copies each client trained
    assert sorted(average) == [f"prompts.{i}" for i in range(4)]
    total = sum(samples.values())
    for k, v in average.items():
        want = sum(samples[c] * mine[c][k].double() for c in range(4)) / total
        assert torch.allclose(v.double(), want, rtol=0, atol=1e-6)
        assert not torch.equal(mine[0][k], mine[1][k])
    starts = _spy_starts(monkeypatch)
    final = _run(tiny_run_files, tmp_path, share="prompts")                 # round 2, resumed
    assert sorted(c for c, _ in starts) == [0, 1, 2, 3]
    for c, got in starts:
        for k, v in got.items():
            want = average[k] if k.startswith("prompts.") else mine[c][k]   # the group's prompts, its own head
            assert torch.equal(v, want), (c, k)
    assert not torch.equal(final.personal_states[0]["prompts.0"], final.personal_states[1]["prompts.0"])


def test_plus_p_clients_trained_together_equal_one_by_one(tiny_run_files, tmp_path, monkeypatch):
    together = _run(tiny_run_files, tmp_path / "a", keep_optimizer=False, share="prompts")
    monkeypatch.setattr(loop, "_why_not_together", lambda method: "forced one by one")
    alone = _run(tiny_run_files, tmp_path / "b", keep_optimizer=False, share="prompts")
    for c, state in together.personal_states.items():
        for k, v in state.items():
            assert torch.allclose(v, alone.personal_states[c][k], atol=1e-5), (c, k)
    (a,), (b,) = together.server_state[SHARED].values(), alone.server_state[SHARED].values()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert abs(together.metrics["value"].to_numpy() - alone.metrics["value"].to_numpy()).max() < 1e-4


def test_plus_h_heterogeneous_vits_average_heads_per_width_and_resume_exactly(hetero_files, tmp_path, monkeypatch):
    uplinks: list[set[str]] = []
    original = FedHPLServer.aggregate
    monkeypatch.setattr(FedHPLServer, "aggregate", lambda self, info, state, results: uplinks.extend(
        set(r.uplink) | {f"model.{k}" for k in r.uplink["model"]} for r in results) or original(
        self, info, state, results))
    samples = _spy_samples(monkeypatch)
    starts = _spy_starts(monkeypatch)
    archs = ("vit_mini_s", "vit_mini", "vit_mini_l")
    full = _hetero(hetero_files, tmp_path / "full", archs, share="head")
    assert uplinks and all(u == {"logits", "labels", "model", "model.head.weight", "model.head.bias"} for u in uplinks)
    groups = full.server_state[SHARED]
    assert sorted(g["head.weight"].shape[1] for g in groups.values()) == [32, 64, 80]
    mine = full.personal_states
    for group in ((0, 4), (1, 3), (2,)):
        (avg,) = [g for g in groups.values() if g["head.weight"].shape == mine[group[0]]["head.weight"].shape]
        total = sum(samples[c] for c in group)
        for k, v in avg.items():
            want = sum(samples[c] * mine[c][k].double() for c in group) / total
            assert torch.allclose(v.double(), want, rtol=0, atol=1e-6), (group, k)
    round2 = dict(starts[5:10])                                             # heads loaded at round 2's start
    assert torch.equal(round2[0]["head.weight"], round2[4]["head.weight"])
    assert torch.equal(round2[1]["head.weight"], round2[3]["head.weight"])
    assert not torch.equal(round2[0]["prompts.0"], round2[4]["prompts.0"])  # +H: prompts stay personal
    m = full.metrics
    _check_rows(m)
    ups = m[m.metric == "upload_count"].set_index(["round", "client"])["value"]
    sent = m[(m.metric == "upload_numbers") & (m.client >= 0)].set_index(["round", "client"])["value"]
    head = pd.Series({c: C * d + C for c, d in enumerate([32, 64, 80, 64, 32])})   # the head's weight and bias
    assert (sent == ups * (C + 1) + head.reindex(ups.index, level="client")).all()
    assert _hetero(hetero_files, tmp_path / "cut", archs, stop=1, share="head") is None
    resumed = _hetero(hetero_files, tmp_path / "cut", archs, share="head")
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
    for c, state in full.client_states.items():
        for k, v in state["model"].items():
            assert torch.equal(v, resumed.client_states[c]["model"][k]), (c, k)
    for sig, g in groups.items():
        assert all(torch.equal(v, resumed.server_state[SHARED][sig][k]) for k, v in g.items())
