"""SGPT: Select and its calibration, the key loss, block coordinate descent, server aggregation, sizes."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import timm
import torch
from torch.nn import functional as F

from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import build_vit
from fedcore.data.arrays import save_bundle
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, module_state
from fedcore.artifacts.select_queries import compute_select_queries
from fedcore.methods import sgpt as sgpt_module
from fedcore.methods.sgpt import (QUERY, SGPT, aggregate_keys, assign, orthogonal_keys, select_groups,
                                  select_scores)
from fedcore.partition.make import make_partition
from fedcore.train import train_run
from tests.conftest import identity, run_params, synthetic_bundle

PARAMS = {"groups": 3, "shared_blocks": [0], "group_blocks": [1, 2], "select_block": 3}


def _method(**over) -> SGPT:
    torch.manual_seed(0)
    return SGPT(PromptedViT(build_vit("vit_mini")), 4, {**PARAMS, **over})


def _dim(method: SGPT) -> int:
    return method.backbones[0].embed_dim


def _client(method: SGPT, n: int = 24, batch: int = 8) -> ClientData:
    """A client whose batches carry random images and Select queries (batch extra) with fixed labels."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 16, 16, generator=gen)
    q = torch.randn(n, _dim(method), generator=gen)
    y = torch.arange(n) % 4

    def batches():
        for s in range(0, n, batch):
            idx = torch.arange(s, min(s + batch, n))
            yield Batch(x[idx], y[idx], idx, {QUERY: q[idx]})
    return ClientData(0, n, batches, gen)


def _assign(m: SGPT, q: torch.Tensor, train: bool, freq: torch.Tensor | None = None):
    """Select for the method's current keys (``freq``: the training-time calibration q_g, None before counts)."""
    return assign(q, m.model.keys, m.params, freq, train=train)


SETTINGS = TrainSettings(local_epochs=1, batch_size=8, optimizer={"name": "sgd", "lr": 0.5, "momentum": 0.9})


def test_orthogonal_keys_are_orthogonal():
    torch.manual_seed(0)
    k = orthogonal_keys(5, 16)
    gram = k @ k.T
    assert torch.allclose(gram[1:, 1:], torch.eye(4), atol=1e-5)       # keys 1.. are orthonormal
    assert torch.allclose(gram[0, 1:], torch.zeros(4), atol=1e-5)       # and orthogonal to key 0


def test_calibration_prefers_rarely_used_groups():
    m = _method()
    with torch.no_grad():
        m.model.keys.zero_()
        m.model.keys[0, 0] = 1.0
        m.model.keys[1, 1] = 1.0
        m.model.keys[2, 2] = 1.0
    q = torch.zeros(1, _dim(m))
    q[0, 0], q[0, 1] = 1.0, 0.9                # closer to key 0 than to key 1
    assert int(_assign(m, q, train=False)[0]) == 0
    assert int(_assign(m, q, train=True, freq=None)[0]) == 0   # round 1: no counts yet -> plain argmin
    freq = torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64)   # group 0 used 18x more often
    assert int(_assign(m, q, train=True, freq=freq)[0]) == 1
    assert int(_assign(m, q, train=False, freq=freq)[0]) == 0  # inference never calibrates


def test_select_query_is_the_raw_feature_unless_query_relu():
    """The paper's Eq. 5/6 take cos(h, k_g) on the raw CLS feature; ``query_relu`` takes the official code's
    cos(ReLU(h), k_g): a query with a negative coordinate picks different groups under the two."""
    paper, code = _method(), _method(query_relu=True)
    assert paper.params["query_relu"] is False and code.params["query_relu"] is True
    for m in (paper, code):
        with torch.no_grad():
            m.model.keys.zero_()
            m.model.keys[0, 1] = 1.0               # key 0 along +e1
            m.model.keys[1, 0] = -1.0              # key 1 along -e0
            m.model.keys[2, 2] = 1.0
    q = torch.zeros(1, _dim(paper))
    q[0, 0], q[0, 1] = -1.0, 0.2                   # raw: nearest to -e0; ReLU'd: (0, 0.2), along +e1
    k = paper.model.keys
    assert torch.allclose(select_scores(q, k), F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).T)
    assert torch.allclose(select_scores(q, k, relu=True), F.normalize(F.relu(q), dim=-1) @ F.normalize(k, dim=-1).T)
    for train in (False, True):
        assert int(_assign(paper, q, train=train)[0]) == 1
        assert int(_assign(code, q, train=train)[0]) == 0
    assert int(select_groups(q, k)) == 1 and int(select_groups(q, k, relu=True)) == 0
    # the key loss is -cos with the query each variant selects with
    assert float(_assign(paper, q, train=True)[1].detach()) == pytest.approx(-1.0 / float(q.norm()), rel=1e-5)
    assert float(_assign(code, q, train=True)[1].detach()) == pytest.approx(-1.0, rel=1e-5)


def test_batch_vote_gives_the_whole_batch_its_mode_group():
    m = _method(batch_vote=True)
    q = torch.randn(9, _dim(m))
    plain = select_groups(q, m.model.keys)
    voted, _ = _assign(m, q, train=True)
    assert (voted == torch.bincount(plain, minlength=3).argmax()).all()


def test_key_loss_reaches_only_the_keys():
    m = _method()
    q = torch.randn(6, _dim(m))
    _, key_loss = _assign(m, q, train=True)
    key_loss.backward()
    grads = {n for n, p in m.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == {"keys"}


def _fit(m: SGPT) -> tuple[list[set[str]], FitResult]:
    """Which tensors each phase of one local update (round 1: v is still zero) changed, and its result."""
    changed, original = [], sgpt_module.run_epochs

    def spy(params, data, settings, epochs, loss_fn, *args, **kwargs):
        before = {n: p.detach().clone() for n, p in m.model.named_parameters()}
        out = original(params, data, settings, epochs, loss_fn, *args, **kwargs)
        changed.append({n for n, p in m.model.named_parameters() if not torch.equal(p.detach(), before[n])})
        return out
    server = m.strategy.init_state(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sgpt_module, "run_epochs", spy)
        _, result = m.client.fit(0, m.client.init_state(0), m.strategy.configure(server, 0), _client(m), SETTINGS)
    return changed, result


def _changed_per_phase(m: SGPT) -> list[set[str]]:
    """Which tensors each phase of one local update changed."""
    return _fit(m)[0]


def test_block_coordinate_descent_separates_the_blocks():
    m = _method()
    (block1, block2), result = _fit(m)
    assert block1 == {"shared.0", "head.weight", "head.bias"}               # Block I: no group prompts, no keys
    assert block2 == {"group.0", "group.1", "keys", "head.weight", "head.bias"}  # Block II: shared frozen
    assert float(result.uplink["select_counts"].sum()) == 24                  # each sample counted once per epoch
    assert set(m.trainable_keys(0)) == {"shared.0", "group.0", "group.1", "keys", "head.weight", "head.bias"}
    # the phases restore every requires_grad flag
    assert {n for n, p in m.model.named_parameters() if p.requires_grad} == set(m.trainable_keys(0))


def test_schedules_of_the_table3_variants():
    assert _changed_per_phase(_method(schedule="joint"))[0] >= {"shared.0", "group.0", "keys"}
    inv = _changed_per_phase(_method(schedule="bcd_inv"))
    assert "shared.0" not in inv[0] and "keys" in inv[0] and inv[1] == {"shared.0", "head.weight", "head.bias"}
    assert _changed_per_phase(_method(group_blocks=[])) == [{"shared.0", "head.weight", "head.bias"}]
    only_group = _changed_per_phase(_method(shared_blocks=[]))
    assert len(only_group) == 1 and "keys" in only_group[0]


def test_key_aggregation_weights_and_uniform_fallback():
    keys = [torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [1.0, 0.0]])]
    counts = torch.tensor([[60.0, 10.0], [40.0, 10.0]], dtype=torch.float64)
    out = aggregate_keys(keys, counts, [1.0, 3.0], "counts", fallback=50)
    assert torch.allclose(out[0], torch.tensor([0.6, 0.4]))   # group 0: N_g^i / sum_i N_g^i
    assert torch.allclose(out[1], torch.tensor([0.5, 0.5]))   # group 1: 20 <= 50 selections -> 1/m
    fedavg = aggregate_keys(keys, counts, [1.0, 3.0], "samples", fallback=50)
    assert torch.allclose(fedavg[0], torch.tensor([0.25, 0.75]))  # plain N_i weights (Table 4 "FedAvg")
    # the default (the paper's weights wherever defined): group 1 counted too; uniform only where nobody chose it
    assert _method().params["key_fallback_count"] == 0
    paper = aggregate_keys(keys, counts, [1.0, 3.0], "counts", fallback=0)
    assert torch.allclose(paper[1], torch.tensor([0.5, 0.5]))      # 10 / 20 each
    lopsided = torch.tensor([[60.0, 15.0], [40.0, 5.0]], dtype=torch.float64)
    assert torch.allclose(aggregate_keys(keys, lopsided, [1.0, 3.0], "counts", fallback=0)[1],
                          torch.tensor([0.25, 0.75]))              # 15 / 20 of client 0's row [0, 1] + 5 / 20 of [1, 0]
    assert torch.allclose(aggregate_keys(keys, lopsided, [1.0, 3.0], "counts", fallback=50)[1],
                          torch.tensor([0.5, 0.5]))                # the code's fallback: 20 <= 50 -> 1/m
    unseen = torch.tensor([[60.0, 0.0], [40.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(aggregate_keys(keys, unseen, [1.0, 3.0], "counts", fallback=0)[1], torch.tensor([0.5, 0.5]))


def test_server_momentum_and_counter():
    m = _method(key_momentum=0.25, group_momentum=0.75)
    names = m.client.shared_keys(m.keys(0))
    prev = {n: torch.zeros_like(v) for n, v in module_state(m.model, names).items()}
    results = []
    for cid, (val, cnt) in enumerate(((1.0, [100.0, 0.0, 0.0]), (3.0, [100.0, 0.0, 0.0]))):
        u = {n: torch.full_like(v, val) for n, v in prev.items()}
        results.append(FitResult(cid, 1, {"model": u, "select_counts": torch.tensor(cnt, dtype=torch.float64)}, {}))
    server = {**m.strategy.init_state(2), "model": prev}
    assert server["v"].tolist() == [0.0, 0.0, 0.0]
    server = m.strategy.aggregate(RoundInfo(1, 2, 1.0, 0), server, results)
    new = server["model"]
    assert torch.allclose(new["head.weight"], torch.full_like(prev["head.weight"], 2.0))  # plain average
    assert torch.allclose(new["shared.0"], torch.full_like(prev["shared.0"], 2.0))        # no momentum
    assert torch.allclose(new["group.0"], torch.full_like(prev["group.0"], 0.25 * 2.0))    # (1 - a_g) * avg
    assert torch.allclose(new["keys"], torch.full_like(prev["keys"], 0.75 * 2.0))          # (1 - a_k) * avg
    assert server["v"].tolist() == [200.0, 0.0, 0.0]


def test_trainable_parameter_count_matches_the_spec():
    """Spec §2: CIFAR-100 s=10 on ViT-B/16 = 141,412 (head 76,900 + shared 3,072 + group 46,080 + keys 15,360)."""
    with torch.device("meta"):
        vit = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
        m = SGPT(PromptedViT(vit), 100, {"groups": 20, "shared_blocks": [0, 1, 2, 3], "group_blocks": [4, 5, 6]})
    assert sum(m.model.get_parameter(n).numel() for n in m.trainable_keys(0)) == 141_412


@pytest.fixture(scope="module")
def sgpt_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgpt")
    bundle = synthetic_bundle()
    bundle.train.coarse, bundle.test.coarse = bundle.train.y // 2, bundle.test.y // 2
    save_bundle(bundle, root / "data.npz")
    make_partition({"scheme": "classes_per_client", "clients": 4, "classes_per_client": 2}, 0,
                   bundle.train.y, bundle.test.y).save(root / "part.npz")
    torch.manual_seed(0)
    torch.save(build_vit("vit_mini").state_dict(), root / "vit.pt")
    compute_select_queries(root / "data.npz", "vit_mini", root / "vit.pt", 3, root / "q.npz", device="cpu")
    return root


def _run(root, name: str, tag: str, **method_params) -> pd.DataFrame:
    params = run_params(rounds=3, participation=0.5)
    params["method"] = "sgpt"
    params["method_params"] = {**PARAMS, "groups": 2, **method_params}
    train_run(params, identity(name), root / "data.npz", root / "part.npz", "vit_mini", root / "vit.pt",
              root / f"{tag}.parquet", root / f"{tag}.pt", device="cpu", progress=False,
              artifacts={QUERY: root / "q.npz"})
    return pd.read_parquet(root / f"{tag}.parquet")


def test_sgpt_end_to_end_logs_selection_and_clustering(sgpt_files):
    df = _run(sgpt_files, "sgpt", "a")
    acc = df[(df.split == "global") & (df.metric == "acc")].value
    assert len(acc) == 3 and np.isfinite(acc).all()
    trace = df[(df.split == "train") & df.metric.str.startswith("select_g")]
    assert set(trace.client) == {0} and len(trace) == 3 * 2                # 2 groups, every round
    per_round = trace.groupby("round").value.sum()
    assert (per_round == per_round.iloc[0]).all()                          # all of client 0's train images
    cluster = df[df.metric == "select_cluster_acc"].value
    assert len(cluster) == 3 and ((cluster >= 0.5) & (cluster <= 1)).all()  # 2 coarse classes, 2 groups
    final = torch.load(sgpt_files / "a.pt", weights_only=False)
    assert float(final["server"]["v"].sum()) > 0
    pd.testing.assert_frame_equal(df, _run(sgpt_files, "sgpt", "b"))      # deterministic


def test_wrong_select_block_is_refused(sgpt_files):
    with pytest.raises(ValueError, match="select_block"):
        _run(sgpt_files, "sgpt", "c", select_block=2)


def test_counter_per_client_adds_each_result_before_the_next_client():
    """``counter_update: per_client`` (official code): the second client's downlink already holds the first
    client's counts; after the round v is the same as with Alg. 2's once-per-round update."""
    results = [FitResult(c, 1, {"model": {}, "select_counts": torch.tensor(n, dtype=torch.float64)}, {})
               for c, n in ((0, [3.0, 1.0, 0.0]), (1, [0.0, 2.0, 5.0]))]
    info = RoundInfo(1, 2, 1.0, 0)
    finals = {}
    for timing in ("per_round", "per_client"):
        m = _method(counter_update=timing)
        server = m.strategy.init_state(2)
        server = m.strategy.observe(info, server, results[0])
        second = m.strategy.configure(server, 1)["v"].tolist()
        assert second == ([3.0, 1.0, 0.0] if timing == "per_client" else [0.0, 0.0, 0.0])
        server = m.strategy.observe(info, server, results[1])
        results_with_models = [FitResult(r.cid, 1, {**r.uplink, "model": module_state(
            m.model, m.client.shared_keys(m.keys(0)))}, {}) for r in results]
        finals[timing] = m.strategy.aggregate(info, server, results_with_models)["v"].tolist()
    assert finals["per_round"] == finals["per_client"] == [3.0, 3.0, 5.0]


def test_counter_timing_changes_a_run_with_several_clients(sgpt_files):
    a = _run(sgpt_files, "sgpt", "per_round")
    b = _run(sgpt_files, "sgpt", "per_client", counter_update="per_client")
    acc = "split == 'global' and metric == 'acc'"
    assert len(a.query(acc)) == len(b.query(acc)) == 3
    losses = "client >= 0 and split == 'train' and metric == 'loss'"
    assert not np.allclose(a.query(losses).value, b.query(losses).value)   # later clients calibrate differently


@pytest.mark.parametrize("grouped", [False, True])
def test_cvpr_era_pooling_averages_cls_and_every_prompt_token(grouped):
    """pooling cls_prompts (the code of the paper's time): head(mean of every non-patch token); cls_group: CLS
    (+ group tokens when grouped), as the released code."""
    m = _method(pooling="cls_prompts", shared_blocks=[0, 1])
    x = torch.randn(2, 3, 16, 16)
    groups = torch.tensor([0, 2]) if grouped else None
    seen = {}

    def keep(tokens):
        seen["tokens"] = tokens
        return tokens
    orig = m.model.backbone.forward_tokens
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m.model.backbone, "forward_tokens", lambda *a, **k: keep(orig(*a, **k)))
        logits = m.model(x, groups)
    tokens = seen["tokens"]
    patches = (16 // m.model.backbone.patch_size) ** 2
    prompt_tokens = tokens.shape[1] - patches - 1  # what insertion added: 2 shared (+ 2 group) tokens
    assert prompt_tokens == 2 + (2 if grouped else 0)
    torch.testing.assert_close(logits, m.model.head(tokens[:, : 1 + prompt_tokens].mean(1)))
    m.model.pooling = "cls_group"
    expected = tokens[:, :3].mean(1) if grouped else tokens[:, 0]
    torch.testing.assert_close(m.model(x, groups), m.model.head(expected))


def test_select_cluster_acc_scores_the_whole_test_set():
    """Table 4 (paper §5.3.1: "clustering accuracy using the CIFAR-100 test dataset"): Select is scored on every
    test image, not only on the union of the clients' local test sets (~75 % of CIFAR-100's at s=50)."""
    from fedcore.engine.data import DeviceSplit
    from fedcore.engine.evaluate import EvalSets
    from fedcore.engine.roles import RoundContext
    from fedcore.metrics import hungarian_accuracy

    m = _method()
    gen = torch.Generator().manual_seed(3)
    n = 40
    q = torch.randn(n, _dim(m), generator=gen)
    coarse = torch.randint(0, 3, (n,), generator=gen)
    test = DeviceSplit(torch.zeros(n, 16, 16, 3, dtype=torch.uint8), coarse.clone(), coarse=coarse,
                       extras={QUERY: q})
    local = [torch.arange(0, 10), torch.arange(10, 20)]          # the clients hold half of the test images
    train = DeviceSplit(torch.zeros(1, 16, 16, 3, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
    ctx = RoundContext(1, True, train, [torch.arange(1)], EvalSets(test, local, test, "pooled_local"), None, 8)
    rows = m.evaluator.round_rows(ctx, m.model, {})
    got = [v for c, s, metric, v in rows if metric == "select_cluster_acc"]
    want = hungarian_accuracy(select_groups(q, m.model.keys).numpy(), coarse.numpy())
    assert got == [pytest.approx(want)]
    pooled = hungarian_accuracy(select_groups(q[:20], m.model.keys).numpy(), coarse[:20].numpy())
    assert want != pytest.approx(pooled)                           # the test tells the two sets apart


def test_select_cluster_acc_uses_the_runs_query_transform():
    """Table 4 scores the Select the run trains with: the raw query by default, the ReLU'd one with ``query_relu``."""
    from fedcore.engine.data import DeviceSplit
    from fedcore.engine.evaluate import EvalSets
    from fedcore.engine.roles import RoundContext
    from fedcore.metrics import hungarian_accuracy

    gen = torch.Generator().manual_seed(5)
    n = 60
    for relu in (False, True):
        m = _method(query_relu=relu)
        q = torch.randn(n, _dim(m), generator=gen)
        coarse = torch.randint(0, 3, (n,), generator=gen)
        test = DeviceSplit(torch.zeros(n, 16, 16, 3, dtype=torch.uint8), coarse.clone(), coarse=coarse,
                           extras={QUERY: q})
        train = DeviceSplit(torch.zeros(1, 16, 16, 3, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
        ctx = RoundContext(1, True, train, [torch.arange(1)], EvalSets(test, [torch.arange(n)], test, "pooled_local"),
                           None, 8)
        got = [v for c, s, metric, v in m.evaluator.round_rows(ctx, m.model, {}) if metric == "select_cluster_acc"]
        assert not torch.equal(select_groups(q, m.model.keys), select_groups(q, m.model.keys, relu=True))
        assert got == [pytest.approx(hungarian_accuracy(select_groups(q, m.model.keys, relu).numpy(), coarse.numpy()))]
