"""Engine: aggregation arithmetic, sampling, determinism, resume equality, what each baseline trains."""
from __future__ import annotations

import logging
import os

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import identity, run_params
from fedcore.engine.aggregation import server_momentum, weighted_average
from fedcore.engine.sampling import clients_per_round, sample_clients
from fedcore.train import train_run


def test_weighted_average_matches_hand_arithmetic():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([4.0])}
    out = weighted_average([a, b], [100, 300])
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))
    assert torch.allclose(out["b"], torch.tensor([3.0]))
    only_w = weighted_average([a, b], [1, 1], names=["w"])
    assert set(only_w) == {"w"} and torch.allclose(only_w["w"], torch.tensor([2.0, 4.0]))


def test_weighted_average_rounds_integer_buffers_instead_of_truncating():
    """BatchNorm's num_batches_tracked (int64) of clients that all took 7 steps averages to 7, not to 6: the float64
    sum 1/3 * 7 + 2/3 * 7 is 6.999..., which a plain cast truncated."""
    states = [{"n": torch.tensor(7), "w": torch.tensor([1.0])}, {"n": torch.tensor(7), "w": torch.tensor([1.0])}]
    out = weighted_average(states, [1, 2])
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 7
    assert int(weighted_average([{"n": torch.tensor(10)}, {"n": torch.tensor(13)}], [3, 7])["n"]) == 12  # 12.1


def test_weighted_average_rejects_bad_weights():
    with pytest.raises(ValueError, match="positive sum"):
        weighted_average([{"w": torch.ones(1)}], [0.0])
    with pytest.raises(ValueError, match="one weight per state, got 2 states and 1 weights"):
        weighted_average([{"w": torch.ones(1)}, {"w": torch.ones(1)}], [1.0])


def test_server_momentum():
    prev, cur = {"k": torch.tensor([1.0])}, {"k": torch.tensor([3.0])}
    assert torch.allclose(server_momentum(prev, cur, 0.5)["k"], torch.tensor([2.0]))
    assert torch.allclose(server_momentum(prev, cur, 0.0)["k"], torch.tensor([3.0]))
    with pytest.raises(ValueError, match="momentum"):
        server_momentum(prev, cur, 1.5)


def test_sampling_is_seeded_and_sized():
    assert clients_per_round(100, 0.05) == 5 and clients_per_round(20, 0.1) == 2 and clients_per_round(3, 0.01) == 1
    a = sample_clients(100, 0.05, seed=0, round_idx=7)
    assert a == sample_clients(100, 0.05, seed=0, round_idx=7) and len(set(a)) == 5 and a == sorted(a)
    assert a != sample_clients(100, 0.05, seed=0, round_idx=8)
    assert a != sample_clients(100, 0.05, seed=1, round_idx=7)
    assert sample_clients(4, 1.0, 0, 1) == [0, 1, 2, 3]


def _train(files, tmp, method="fedvpt", seed=0, stop=None, ckpt=True, **kw):
    return train_run(run_params(**kw), identity(method, seed), files["dataset"], files["partition"], "vit_mini",
                     files["weights"], tmp / "metrics.parquet", tmp / "final.pt",
                     checkpoint_path=(tmp / "ckpt.pt") if ckpt else None, progress=False, stop_after_round=stop)


def test_same_seed_same_metrics_and_other_seed_differs(tiny_run_files, tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    a = _train(tiny_run_files, tmp_path / "a").metrics
    b = _train(tiny_run_files, tmp_path / "b").metrics
    pd.testing.assert_frame_equal(a, b)
    c = _train(tiny_run_files, tmp_path / "c", seed=1).metrics
    assert not a["value"].equals(c["value"])


def test_interrupted_run_resumes_to_identical_metrics(tiny_run_files, tmp_path):
    (tmp_path / "full").mkdir(), (tmp_path / "cut").mkdir()
    full = _train(tiny_run_files, tmp_path / "full", rounds=4)
    assert _train(tiny_run_files, tmp_path / "cut", rounds=4, stop=2) is None  # "killed" after round 2
    assert (tmp_path / "cut" / "ckpt.pt").exists() and not (tmp_path / "cut" / "metrics.parquet").exists()
    resumed = _train(tiny_run_files, tmp_path / "cut", rounds=4)
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
    for name, t in full.global_state.items():
        assert torch.equal(t, resumed.global_state[name]), name
    written = pd.read_parquet(tmp_path / "cut" / "metrics.parquet")
    pd.testing.assert_frame_equal(written, full.metrics)


def test_finished_run_keeps_its_checkpoint_and_a_rerun_rebuilds_its_outputs(tiny_run_files, tmp_path, caplog):
    """Snakemake deletes the outputs of a job it was interrupted during, though the job finished: the rerun
    rebuilds them from the kept last checkpoint without training again."""
    full = _train(tiny_run_files, tmp_path, rounds=3)
    assert (tmp_path / "ckpt.pt").exists()
    for name in ("metrics.parquet", "final.pt"):
        (tmp_path / name).unlink()
    with caplog.at_level(logging.INFO, logger="fedcore.engine.loop"):
        again = _train(tiny_run_files, tmp_path, rounds=3)
    assert "resuming from round 3 of 3" in caplog.text
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "metrics.parquet"), full.metrics)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, t in full.global_state.items():
        assert torch.equal(t, again.global_state[name]) and torch.equal(t, final["global"][name]), name


def test_checkpoint_older_than_a_file_the_run_reads_is_not_resumed(tiny_run_files, tmp_path, caplog):
    code = tmp_path / "method.py"
    code.write_text("# the method's code\n")

    def run(work, stop=None):
        return train_run(run_params(rounds=3), identity("fedvpt"), tiny_run_files["dataset"],
                         tiny_run_files["partition"], "vit_mini", tiny_run_files["weights"], work / "m.parquet",
                         work / "f.pt", checkpoint_path=work / "ckpt.pt", progress=False, stop_after_round=stop,
                         depends_on=[code])

    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    clean = run(tmp_path / "c").metrics
    with caplog.at_level(logging.INFO, logger="fedcore.engine.loop"):
        assert run(tmp_path / "a", stop=2) is None and run(tmp_path / "b", stop=2) is None
        caplog.clear()
        pd.testing.assert_frame_equal(run(tmp_path / "a").metrics, clean)   # unchanged inputs: resumed
        assert "resuming from round 2 of 3" in caplog.text
        caplog.clear()
        written = (tmp_path / "b" / "ckpt.pt").stat().st_mtime
        os.utime(code, (written + 5, written + 5))                          # the method edited after
        pd.testing.assert_frame_equal(run(tmp_path / "b").metrics, clean)
        assert "is older than " + str(code) in caplog.text and "resuming" not in caplog.text


def test_checkpoint_from_other_settings_is_not_resumed(tiny_run_files, tmp_path):
    def run(lr, work, stop=None):
        params = run_params(rounds=3)
        params["optimizer"]["lr"] = lr
        return train_run(params, identity("fedvpt"), tiny_run_files["dataset"], tiny_run_files["partition"],
                         "vit_mini", tiny_run_files["weights"], work / "m.parquet", work / "f.pt",
                         checkpoint_path=tmp_path / "ckpt.pt", progress=False, stop_after_round=stop)

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert run(0.05, tmp_path / "a", stop=2) is None            # leaves a round-2 checkpoint for lr 0.05
    other = run(0.01, tmp_path / "a").metrics                    # lr changed: must start from round 1
    clean = run(0.01, tmp_path / "b").metrics                    # reference: no checkpoint at all
    pd.testing.assert_frame_equal(other, clean)


@pytest.mark.parametrize("method", ["fedavg", "fedvpt", "fedvpt_d", "head_tune", "local"])
def test_each_baseline_trains_what_it_says(tiny_run_files, tmp_path, method):
    res = _train(tiny_run_files, tmp_path, method=method, rounds=2, participation=1.0, ckpt=False)
    m = res.metrics
    agg = m[(m.client == -1) & (m.split == "global") & (m.metric == "acc")]
    assert list(agg["round"]) == [1, 2] and agg["value"].between(0, 1).all()
    assert set(m[(m.split == "local") & (m.client >= 0)]["client"]) == {0, 1, 2, 3}
    worst = m[(m.metric == "acc_worst")]["value"].to_numpy()
    mean = m[(m.metric == "acc_mean")]["value"].to_numpy()
    assert (worst <= mean + 1e-12).all()
    sent = m[(m.metric == "upload_numbers") & (m.split == "train")].pivot(index="round", columns="client",
                                                                          values="value")
    total = m[m.metric == "upload_numbers_total"].set_index("round")["value"]
    mean = m[m.metric == "upload_numbers_mean"].set_index("round")["value"]
    assert list(sent.columns) == [0, 1, 2, 3] and (sent.sum(axis=1) == total).all() and (total / 4 == mean).all()
    state = torch.load(tmp_path / "final.pt", weights_only=False)
    if method == "local":
        assert (total == 0).all()                                          # nothing leaves a Local client
        assert state["global"] == {} and set(state["personal"]) == {0, 1, 2, 3}
        assert (m[(m.split == "global") & (m.client >= 0)]["client"].nunique()) == 4  # per-client global acc
    else:
        names = set(state["global"])
        assert (sent.iloc[0] >= sum(state["global"][n].numel() for n in names)).all()   # at least the model sent
        assert any(n.startswith("head.") for n in names)
        has_backbone = any(n.startswith("net.") for n in names)
        has_prompts = any(n.startswith("prompts.") for n in names)
        assert has_backbone == (method == "fedavg")
        assert has_prompts == (method in ("fedvpt", "fedvpt_d"))
        if method == "fedvpt_d":
            assert sum(n.startswith("prompts.") for n in names) == 4  # one per block of vit_mini


def test_frozen_backbone_is_not_changed_by_prompt_methods(tiny_run_files, tmp_path):
    from fedcore.backbones.vit import build_vit
    from fedcore.backbones.prompted import PromptedViT
    from fedcore.methods import method_class

    vit = build_vit("vit_mini", tiny_run_files["weights"])
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    from fedcore.engine.data import Batch

    method = method_class("fedvpt_d")(PromptedViT(vit), 4, {})
    x = torch.randn(8, 3, 16, 16)
    loss = method.client.loss(method.model, Batch(x, torch.arange(8) % 4, torch.arange(8), {}))
    loss.backward()
    assert all(p.grad is None for p in vit.parameters())
    assert all(p.grad is not None for p in method.model.prompts)
    assert all(torch.equal(before[k], v) for k, v in vit.state_dict().items())


def test_a_run_whose_state_goes_non_finite_trains_on_and_records_each_round(tiny_run_files, tmp_path, caplog):
    """lr = inf sends FedVPT's prompts to NaN/inf in round 1: the run goes on to its last round, as the papers' code
    would, but each round adds a `diverged` row (how many tensors) and the log says so; a healthy run has none."""
    params = run_params(rounds=2)
    params["optimizer"]["lr"] = float("inf")
    with caplog.at_level(logging.WARNING, logger="fedcore.engine.loop"):
        m = train_run(params, identity("fedvpt"), tiny_run_files["dataset"], tiny_run_files["partition"], "vit_mini",
                      tiny_run_files["weights"], tmp_path / "m.parquet", tmp_path / "f.pt", progress=False).metrics
    div = m[m["metric"] == "diverged"]
    assert div["round"].tolist() == [1, 2] and (div["client"] == -1).all() and (div["split"] == "train").all()
    assert (div["value"] >= 1).all() and "round 1:" in caplog.text and "hold NaN or inf" in caplog.text
    assert m["round"].max() == 2  # trained on
    (tmp_path / "ok").mkdir()
    assert not (_train(tiny_run_files, tmp_path / "ok", rounds=2).metrics["metric"] == "diverged").any()


def test_nonfinite_paths_name_each_bad_floating_tensor_through_nested_payloads():
    from fedcore.engine.health import nonfinite_paths

    bad = torch.tensor([1.0, float("nan")])
    payloads = {"server": {"w": torch.ones(2), "m": [torch.zeros(1), {"b": torch.tensor([float("inf")])}]},
                "client3": (bad, torch.tensor([7])), "client4": None}
    assert nonfinite_paths(payloads) == ["server.m[1].b", "client3[0]"]
    assert nonfinite_paths({"server": {"n": torch.tensor([1]), "e": torch.empty(0)}}) == []  # ints, empty: finite
    assert nonfinite_paths({}) == []


def test_unknown_method_param_is_rejected(tiny_run_files):
    from fedcore.backbones.prompted import PromptedViT
    from fedcore.backbones.vit import build_vit
    from fedcore.methods import method_class

    with pytest.raises(ValueError, match=r"method_params.fedvpt: unknown key\(s\) \['prompt_len'\]"):
        method_class("fedvpt")(PromptedViT(build_vit("vit_mini")), 4, {"prompt_len": 3})


def test_cached_features_give_the_same_numbers_as_the_full_forward(tiny_run_files, tmp_path, monkeypatch):
    """Head-Tune's feature cache is a pure speed-up: metrics equal those of running the backbone each step."""
    import fedcore.train
    from fedcore.engine.roles import Client, Evaluator
    from fedcore.methods.head_tune import HeadTune

    class Uncached(HeadTune):
        client_role, evaluator_role = Client, Evaluator

        def frozen_features(self):
            return None

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    cached = _train(tiny_run_files, tmp_path / "a", method="head_tune", ckpt=False).metrics
    monkeypatch.setattr(fedcore.train, "method_class", lambda name: Uncached)
    full = _train(tiny_run_files, tmp_path / "b", method="head_tune", ckpt=False).metrics
    pd.testing.assert_frame_equal(cached.drop(columns="value"), full.drop(columns="value"))
    acc = cached["metric"] != "loss"
    assert (cached["value"][acc].to_numpy() == full["value"][acc].to_numpy()).all()
    assert abs(cached["value"][~acc].to_numpy() - full["value"][~acc].to_numpy()).max() < 1e-5


def test_unreadable_checkpoint_is_reported_not_overwritten(tiny_run_files, tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match=r"checkpoint .*ckpt.pt cannot be read .*delete it"):
        _train(tiny_run_files, tmp_path, rounds=2)
    assert (tmp_path / "ckpt.pt").read_bytes() == b"not a checkpoint"


def test_partition_that_does_not_fit_the_dataset_is_rejected_before_training(tiny_run_files, tmp_path):
    from fedcore.partition.file import Partition
    import numpy as np

    bad = Partition(train=[np.array([0, 1, 10_000])], test=[np.array([0])], spec={"scheme": "iid"}, seed=0)
    bad.save(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match=r"client 0 train indices exceed the dataset's 240 train images"):
        train_run(run_params(), identity("fedvpt"), tiny_run_files["dataset"], tmp_path / "bad.npz", "vit_mini",
                  tiny_run_files["weights"], tmp_path / "m.parquet", tmp_path / "f.pt", progress=False)
    assert not (tmp_path / "m.parquet").exists()


@pytest.fixture
def uneven_files(tiny_run_files, tmp_path):
    """The tiny run files with clients of 20, 45, 70 and 105 training images (1, 3, 5 and 7 batches)."""
    import numpy as np
    from fedcore.partition.file import Partition

    cuts = np.cumsum([0, 20, 45, 70, 105])
    perm = np.random.default_rng(0).permutation(240)
    test = np.array_split(np.arange(80), 4)
    Partition([perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])], test, {"scheme": "iid"}, 0).save(tmp_path / "p.npz")
    return {**tiny_run_files, "partition": tmp_path / "p.npz"}


@pytest.mark.parametrize("method", ["fedvpt", "fedvpt_d", "local"])
def test_clients_trained_together_equal_clients_trained_one_by_one(uneven_files, tmp_path, monkeypatch, method):
    """Training a round's clients together (fedcore/engine/together.py) is a pure speed-up of the one-by-one
    loop, also when clients run out of batches at different steps."""
    import fedcore.engine.loop as loop

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    kw = dict(method=method, ckpt=False, rounds=3, participation=1.0, local_epochs=2)
    together = _train(uneven_files, tmp_path / "a", **kw)
    monkeypatch.setattr(loop, "_why_not_together", lambda method: "forced one by one")
    one_by_one = _train(uneven_files, tmp_path / "b", **kw)
    a, b = together.metrics, one_by_one.metrics
    pd.testing.assert_frame_equal(a.drop(columns="value"), b.drop(columns="value"))
    assert abs(a["value"].to_numpy() - b["value"].to_numpy()).max() < 1e-4
    states_a = [together.global_state] if together.global_state else list(together.personal_states.values())
    states_b = [one_by_one.global_state] if one_by_one.global_state else list(one_by_one.personal_states.values())
    for sa, sb in zip(states_a, states_b, strict=True):
        for name in sa:
            assert torch.allclose(sa[name], sb[name], atol=1e-5), name


def test_evaluated_rounds_are_the_first_every_kth_and_the_whole_report_window():
    from fedcore.engine.loop import RunSpec

    spec = RunSpec(identity={}, federation={"rounds": 60}, optimizer={}, evaluation={"every": 5}, final_window=10)
    assert [r for r in range(1, 61) if spec.evaluated(r)] == [1] + list(range(5, 51, 5)) + list(range(51, 61))


def test_last_rounds_are_evaluated_beside_a_shorter_report_window():
    """FedOTP stores its last 5 rounds (the official code's mean) while its tables read the final round."""
    from fedcore.engine.loop import RunSpec

    spec = RunSpec(identity={}, federation={"rounds": 30}, optimizer={},
                   evaluation={"every": 10, "last_rounds": 5}, final_window=1)
    assert [r for r in range(1, 31) if spec.evaluated(r)] == [1, 10, 20, 26, 27, 28, 29, 30]
    wider = RunSpec(identity={}, federation={"rounds": 30}, optimizer={},
                    evaluation={"every": 10, "last_rounds": 2}, final_window=4)
    assert [r for r in range(1, 31) if wider.evaluated(r)] == [1, 10, 20, 27, 28, 29, 30]


def test_checkpoint_fingerprint_covers_method_params():
    from fedcore.engine.loop import RunSpec
    base = dict(identity={"seed": 0}, federation={"rounds": 2}, optimizer={})
    a = RunSpec(**base, method_params={"method": "sgpt", "key_momentum": 0.5})
    b = RunSpec(**base, method_params={"method": "sgpt", "key_momentum": 0.1})
    assert a.fingerprint() != b.fingerprint()   # a resumed run must restart when its method params change
    assert a.fingerprint() == RunSpec(**base, method_params={"key_momentum": 0.5, "method": "sgpt"}).fingerprint()


@pytest.mark.parametrize("method", ["fedvpt", "local"])
def test_per_class_accuracy_rows_add_up_to_the_global_accuracy(tiny_run_files, tmp_path, method):
    """``evaluation.per_class`` adds acc_class<k> on the global test set: per client for personalised models
    (client -1: their mean), for client -1 only with a global model; off, there are none."""
    from fedcore.data.arrays import load_bundle

    def run(out, **evaluation):
        out.mkdir()
        params = {**run_params(rounds=1), "evaluation": {"global_test": "official_test", **evaluation}}
        return train_run(params, identity(method), tiny_run_files["dataset"], tiny_run_files["partition"],
                         "vit_mini", tiny_run_files["weights"], out / "m.parquet", out / "f.pt", progress=False).metrics

    m = run(tmp_path / "on", per_class=True)
    counts = pd.Series(load_bundle(tiny_run_files["dataset"]).test.y).value_counts().sort_index()
    rows = m[m.metric.str.startswith("acc_class")]
    clients = sorted(rows.client.unique())
    assert clients == ([-1, 0, 1, 2, 3] if method == "local" else [-1])
    for c in clients:
        acc = rows[rows.client == c].set_index("metric")["value"]
        acc = acc[[f"acc_class{k}" for k in counts.index]].to_numpy()
        overall = m[(m.client == c) & (m.split == "global") & (m.metric == "acc")]["value"].item()
        assert abs((acc * counts.to_numpy()).sum() / counts.sum() - overall) < 1e-6   # classes weighted by size
    if method == "local":
        mean = rows[rows.client >= 0].groupby("metric")["value"].mean()
        assert (abs(rows[rows.client == -1].set_index("metric")["value"] - mean) < 1e-12).all()
    plain = run(tmp_path / "off")
    assert not plain.metric.str.startswith("acc_class").any()
    pd.testing.assert_frame_equal(plain, m[~m.metric.str.startswith("acc_class")].reset_index(drop=True))


def test_never_sampled_clients_are_counted_then_can_be_left_out(tiny_run_files, tmp_path):
    """A personalised method at participation 0.5: after round 1 two of four clients never trained. Their number is
    logged; with ``untrained_clients: exclude`` the aggregates are over the trained clients only."""
    from conftest import identity, run_params
    from fedcore.train import train_run

    def run(mode: str):
        params = {**run_params(rounds=1, participation=0.5), "evaluation": {"untrained_clients": mode}}
        out = tmp_path / mode
        out.mkdir()
        res = train_run(params, identity("fedrep"), tiny_run_files["dataset"], tiny_run_files["partition"],
                        "vit_mini", tiny_run_files["weights"], out / "m.parquet", out / "f.pt", progress=False)
        return res.metrics.set_index(["client", "split", "metric"])["value"], set(res.client_states)

    inc, trained = run("include")
    exc, _ = run("exclude")
    assert len(trained) == 2 and inc[(-1, "local", "untrained_clients")] == 2.0
    per_client = [inc[(c, "local", "acc")] for c in range(4)]
    assert inc[(-1, "local", "acc_mean")] == pytest.approx(sum(per_client) / 4)
    assert exc[(-1, "local", "acc_mean")] == pytest.approx(sum(per_client[c] for c in trained) / 2)
    assert exc[(-1, "local", "acc_worst")] == min(per_client[c] for c in trained)


def test_domain_size_weights_count_each_domains_whole_train_set():
    """client_weights: domain_size gives a client its domain's whole train set over the domain's clients (the
    official SGPT code's weights), whatever subset it trains on; train_size keeps the engine's sample counts."""
    from fedcore.data.arrays import ArrayDataset
    from fedcore.partition.file import Partition
    from fedcore.train import client_weights

    domain = np.array([0] * 6 + [1] * 3 + [2] * 9)
    split = ArrayDataset(np.zeros((18, 2, 2, 3), np.uint8), np.zeros(18, np.int64), domain=domain)
    spec = {"scheme": "domain", "clients_per_domain": 1}
    part = Partition([np.array([0, 1]), np.array([6, 7]), np.array([9, 10])], [np.array([0])] * 3, spec, 0)
    assert client_weights("train_size", split, part) is None
    assert client_weights("domain_size", split, part) == [6.0, 3.0, 9.0]
    two = Partition([np.array([0]), np.array([1]), np.array([9]), np.array([10])], [np.array([0])] * 4,
                    {**spec, "clients_per_domain": 2}, 0)
    assert client_weights("domain_size", split, two) == [3.0, 3.0, 4.5, 4.5]
    with pytest.raises(ValueError, match="domain partition"):
        client_weights("domain_size", split, Partition(part.train, part.test, {"scheme": "iid"}, 0))

def test_evaluating_a_round_changes_no_other_number(tiny_run_files, tmp_path):
    """Evaluation draws nothing that training sees (FedBABU fine-tunes every client at evaluation, with its own
    seeded draws): a run that also evaluates round 2 has the same numbers in every other row as one that skips it."""
    def run(every: int) -> pd.Series:
        out = tmp_path / f"every{every}"
        out.mkdir()
        params = {**run_params(rounds=3, participation=0.5), "final_window": 1,
                  "method_params": {"finetune_epochs": 1}}
        params["evaluation"] = {**params["evaluation"], "every": every}
        res = train_run(params, identity("fedbabu"), tiny_run_files["dataset"], tiny_run_files["partition"],
                        "vit_mini", tiny_run_files["weights"], out / "m.parquet", out / "f.pt", progress=False)
        return res.metrics.set_index(["round", "client", "split", "metric"])["value"]

    def evaluated(m: pd.Series) -> list[int]:
        return sorted(set(m[m.index.get_level_values("split") != "train"].index.get_level_values("round")))

    each, sparse = run(1), run(3)
    assert evaluated(sparse) == [1, 3] and evaluated(each) == [1, 2, 3]
    pd.testing.assert_series_equal(each.loc[sparse.index], sparse)


def test_plain_batches_give_every_client_sample_once_in_order_without_augmentation():
    """Upload and counting passes (FedGH, FedTGP, FedHE, FedHPL, FedRoD, pFedGate's evaluation gate) read
    ``ClientData.plain_batches``: a last batch of one sample, which training skips for BatchNorm, is kept there, and
    the experiment's augmentation is not applied."""
    from fedcore.engine.data import DeviceSplit, InputPipeline
    from fedcore.engine.loop import _client_data
    from fedcore.engine.optim import TrainSettings

    g = torch.Generator().manual_seed(0)
    split = DeviceSplit(torch.randint(0, 256, (40, 8, 8, 3), generator=g, dtype=torch.uint8), torch.arange(40) % 4)
    idx = torch.arange(3, 20)                                        # 17 samples, batch 8: a last batch of one
    pipe = InputPipeline(8, (0.5,) * 3, (0.25,) * 3)
    data = _client_data(0, 1, 0, idx, split, pipe, TrainSettings(local_epochs=1, batch_size=8, optimizer={}),
                        augment=("flip",), min_batch=2)
    assert sum(len(b.y) for b in data.batches()) == 16
    plain = list(data.plain_batches())
    assert [len(b.y) for b in plain] == [8, 8, 1]
    torch.testing.assert_close(torch.cat([b.x for b in plain]), pipe(split.x[idx]))
    assert torch.equal(torch.cat([b.y for b in plain]), split.y[idx])
