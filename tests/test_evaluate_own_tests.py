"""What a run evaluates, and where: ``evaluation.global_test: none`` (FedOTP, FedPFT: no global accuracy, each
personalised model scores its own client's test set only; the local accuracies are those of the pooled evaluation,
number for number; in one pass the clients' own batches go through together, each read through its own client's
tensors), and a method's own schedule (``method_evaluation``: FedBABU at round 1 and the final round only)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import edited_config, identity, run_params
from fedcore.backbones.prompted import attention_backend
from fedcore.config import ConfigError, load_config
from fedcore.engine import evaluate
from fedcore.engine.evaluate import predict, predict_own_clients
from fedcore.train import train_run
from otp_helpers import clip  # noqa: F401  (clip: a module-scoped fixture)

ROOT = Path(__file__).resolve().parents[1]


def _run(files: dict, out: Path, method: str, global_test: str):
    out.mkdir()
    params = {**run_params(rounds=2, participation=1.0), "evaluation": {"global_test": global_test}}
    return train_run(params, identity(method), files["dataset"], files["partition"], "vit_mini", files["weights"],
                     out / "m.parquet", out / "f.pt", progress=False).metrics


@pytest.mark.parametrize("method", ["local", "fedvpt"])
def test_no_global_test_keeps_every_local_number_and_drops_the_global_ones(learnable_run_files, tmp_path, method):
    """A personalised (Local) and a global (FedVPT) method: the same local rows as with the pooled global test set,
    and no global row at all."""
    pooled = _run(learnable_run_files, tmp_path / "pooled", method, "pooled_local")
    own = _run(learnable_run_files, tmp_path / "own", method, "none")
    assert not (own.split == "global").any()
    kept = pooled[pooled.split != "global"].reset_index(drop=True)
    assert len(kept) == len(own) and (pooled.split == "global").any()
    assert kept[["round", "client", "split", "metric"]].equals(own[["round", "client", "split", "metric"]])
    assert kept["value"].tolist() == own["value"].tolist()


@pytest.mark.parametrize("name", ["local", "coop", "fedotp"])
def test_own_test_sets_in_one_pass_give_each_clients_own_predictions(clip, name, monkeypatch):
    """Clients of uneven test sets (2, 0 and 9 images at batch 4) scored together, two clients a pass: each client's
    predictions are those of its model alone on its own images."""
    from test_onepass import personal_eval_case, stacked_clients

    monkeypatch.setattr(evaluate, "CLIENTS_PER_PASS", 2)
    method, model, states, split, pipeline, server, plan = personal_eval_case(clip, name, 16)
    own = [torch.tensor([3, 0]), torch.tensor([], dtype=torch.long), torch.arange(9)]
    with attention_backend("cpu"):
        stacked, alone = stacked_clients(method, model, plan, server, states,
                                         lambda c: predict(method, model, split, own[c], pipeline, 4))
        together = predict_own_clients(method, model, plan, stacked, split, own, pipeline, 4)
        # the clients' models differ on the whole split, so a mixed-up client row would show
        _, whole = stacked_clients(method, model, plan, server, states,
                                   lambda c: predict(method, model, split, torch.arange(16), pipeline, 4))
    assert [len(p) for p in together] == [2, 0, 9]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    assert len({tuple(p.tolist()) for p in whole}) > 1


def _no_global(exp: dict, **more) -> None:
    exp["evaluation"] = {**exp.get("evaluation", {}), "global_test": "none", **more}


def test_a_table_may_not_read_a_global_metric_of_an_experiment_without_a_global_test(tmp_path):
    root = edited_config(tmp_path, "sgpt", lambda e: _no_global(e["sgpt_five"]))
    top = {**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "papers": ["sgpt"], "outputs": "all"}
    with pytest.raises(ConfigError) as err:
        load_config(top, root)
    msg = str(err.value)
    assert "global_acc" in msg and "'sgpt_five'" in msg and "global_test none" in msg and "sgpt_table1" in msg


def test_per_class_accuracy_needs_a_global_test(tmp_path):
    root = edited_config(tmp_path, "sgpt", lambda e: _no_global(e["sgpt_five"], per_class=True))
    top = {**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "papers": ["sgpt"], "outputs": "all"}
    with pytest.raises(ConfigError, match="experiment sgpt_five: evaluation.per_class reads the global test set"):
        load_config(top, root)


def test_fedotp_scores_own_test_sets_and_no_output_reads_a_global_metric():
    """FedOTP's experiments have no global test set (its code scores each client's prompts on that client's test
    set), and the config loads at every scale: no FedOTP table or figure reads a global metric."""
    for scale in ("mini", "paper"):
        cfg = load_config({**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "papers": ["fedotp"],
                           "outputs": "all", "scale": scale}, ROOT)
        assert {x["evaluation"]["global_test"] for x in cfg.experiments.values()} == {"none"}


def test_a_sparser_schedule_changes_no_evaluated_number(hetero_files, tmp_path):
    """FedBABU (every evaluation fine-tunes) evaluated every round and at round 1 and the last round only
    (``every: 0``): the rounds both evaluate hold the same numbers; the other rounds are simply absent."""
    from fedcore.train import train_run

    def run(out: Path, every: int):
        out.mkdir()
        params = {**run_params(rounds=3, participation=1.0), "method_params": {"init": "random",
                                                                                "finetune_epochs": 1},
                  "evaluation": {"global_test": "official_test", "every": every}, "final_window": 1}
        return train_run(params, identity("fedbabu"), hetero_files["dataset"], hetero_files["partition5"],
                         "resnet_mini_18", hetero_files["weights"]["resnet_mini_18"], out / "m.parquet",
                         out / "f.pt", progress=False).metrics

    every, sparse = run(tmp_path / "every", 1), run(tmp_path / "sparse", 0)
    scored = lambda m: m[m.split.isin(["global", "local"])]   # noqa: E731
    assert sorted(scored(every)["round"].unique()) == [1, 2, 3]
    assert sorted(scored(sparse)["round"].unique()) == [1, 3]
    keep = every[every["round"].isin([1, 3]) | ~every.split.isin(["global", "local"])].reset_index(drop=True)
    assert keep[["round", "client", "split", "metric"]].equals(sparse[["round", "client", "split", "metric"]])
    assert keep["value"].tolist() == sparse["value"].tolist()


def test_fedbabu_alone_has_its_own_schedule_in_fedhpls_experiments():
    """FedHPL: FedBABU evaluated at round 1 and the final round only, every other method every round (paper)."""
    cfg = load_config({**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "papers": ["fedhpl"],
                       "outputs": "all", "scale": "paper"}, ROOT)
    runs = [(r["experiment"], r["method"]) for r in cfg.runs()]
    babu = [e for e, m in runs if m == "fedbabu"]
    assert len(babu) == 9
    for e, m in runs:
        assert cfg.train_params(e, m)["evaluation"]["every"] == (0 if m == "fedbabu" else 1), (e, m)


def test_the_paper_scale_estimate_counts_what_each_run_evaluates():
    """fedcore/estimate.py: FedOTP's personalised clients scoring their own test sets cost one pass over the pooled
    set, not one per client; FedBABU's fine-tuning is counted at its two evaluated rounds only."""
    from dataclasses import replace

    from fedcore.estimate import estimate, estimate_run, run_shape

    cfg = load_config({**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()),
                       "papers": ["fedhpl", "fedotp"], "outputs": "all", "scale": "paper"}, ROOT)
    otp = run_shape(cfg, "otp_c100_a0p3", "fedotp")
    assert otp.own_tests_only and otp.personalized and otp.clients == 100
    pooled = estimate(replace(otp, own_tests_only=False))
    assert pooled.eval_s / estimate(otp).eval_s == pytest.approx(otp.clients, rel=0.02)
    babu, avg = run_shape(cfg, "hpl_c10_iid_homo", "fedbabu"), run_shape(cfg, "hpl_c10_iid_homo", "fedavg")
    assert (babu.evaluated_rounds, avg.evaluated_rounds, babu.rounds) == (2, 100, 100)
    every = estimate(replace(babu, evaluated_rounds=100))
    assert every.train_s > 5 * estimate_run(cfg, "hpl_c10_iid_homo", "fedbabu").train_s


@pytest.mark.parametrize("own, needle", [
    ({"fedavg": {"every": 0}}, "'best' needs every round evaluated, but method_evaluation.fedavg.every=0"),
    ({"fedavgg": {"every": 1}}, "method_evaluation.fedavgg"),
])
def test_a_methods_own_schedule_is_checked(tmp_path, own, needle):
    """FedPFT reports each run's best round: a method evaluated less often is refused, as an unknown method is."""
    def edit(e: dict) -> None:
        e["pft_c100_dir0p5"]["method_evaluation"] = own

    top = {**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "papers": ["fedpft"], "outputs": "all"}
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("'", ".")):
        load_config(top, edited_config(tmp_path, "fedpft", edit))
