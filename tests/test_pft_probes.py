"""FedPFT's probes (spec fedpft §1.12): the linear probe and match layer, a run rebuilt from its final.pt, the
feature kinds and τ's attention, the probe table's cells and the two probe figures."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from conftest import identity, run_params
from fedcore.analysis.linear_probe import ProbeSettings, linear_probe, match_accuracy, predicts_with_head, probe_run
from fedcore.analysis.trained_run import check_against_log, load_trained_run
from fedcore.report.probe_table import build_probe_table

FAST = ProbeSettings(epochs=30, lr=0.1, batch_size=16)


def _blobs(n: int, dim: int = 6, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    centers = torch.eye(dim)[:classes] * 4.0
    return centers[y] + 0.3 * torch.randn(n, dim, generator=g), y


def test_linear_probe_separates_blobs_and_is_deterministic():
    (a, ay), (b, by) = _blobs(60), _blobs(30, seed=1)
    acc = linear_probe(a, ay, b, by, 3, FAST, seed=7)
    assert acc == 1.0
    # chance level on shuffled labels: the probe is scored on held-out data, not memorised
    assert linear_probe(a, ay[torch.randperm(60, generator=torch.Generator().manual_seed(0))], b, by, 3, FAST, 7) < 0.8
    s = ProbeSettings(epochs=2, lr=0.01, batch_size=16)
    assert linear_probe(a, ay, b, by, 3, s, 3) == linear_probe(a, ay, b, by, 3, s, 3)


def test_match_layer_realigns_rotated_features_to_a_frozen_head():
    (a, ay), (b, by) = _blobs(60), _blobs(30, seed=1)
    head = nn.Linear(6, 3)
    with torch.no_grad():
        head.weight.copy_(torch.eye(6)[:3])
        head.bias.zero_()
    perm = torch.tensor([1, 2, 0, 3, 4, 5])  # the classes' feature axes swapped: the head reads the wrong ones
    origin = float((head(b[:, perm]).argmax(1) == by).float().mean())
    assert origin == 0.0
    assert match_accuracy(a[:, perm], ay, b[:, perm], by, head, FAST, seed=0) == 1.0
    assert torch.equal(head.weight, torch.eye(6)[:3])  # the classifier stays frozen
    assert predicts_with_head(head(b), head, b) and not predicts_with_head(head(b) + 1.0, head, b)


def test_the_head_check_compares_logits_made_under_cudas_autocast_with_the_same_autocast():
    """GPU proxy (CUDA's bf16 autocast on the CPU): the run's logits come from ``TrainedRun.apply`` under autocast;
    compared with an fp32 head(feature), logits of a few units differ by bf16 rounding (~1e-2), so on CUDA the match
    layer was silently skipped (NaN). Failed before the check ran the head under the same autocast."""
    from fedcore.engine.optim import autocast_for
    from fedcore.engine.precision import cuda_rules_on_cpu

    torch.manual_seed(0)
    head, feats = nn.Linear(16, 5), torch.randn(40, 16)
    with torch.no_grad():
        head.weight.mul_(8.0)
    with cuda_rules_on_cpu():
        with autocast_for(feats):
            logits = head(feats).float()
        assert logits.abs().max() > 4.0 and not torch.allclose(logits, head(feats), atol=1e-3, rtol=1e-3)
        assert predicts_with_head(logits, head, feats)
        assert not predicts_with_head(logits + 0.1, head, feats)


@pytest.fixture(scope="module")
def pft_run(tiny_run_files, tmp_path_factory):
    """An untrained FedPFT 'run' (initial states saved as its final.pt), rebuilt by load_trained_run."""
    from fedcore.backbones.registry import build_backbone, prompt_adapter
    from fedcore.data.arrays import load_bundle
    from fedcore.methods.fedpft import FedPFT

    mp = {"queue_size": 8, "n_kappa": 3, "n_rho": 2, "feature_epochs": 1}
    params = {**run_params(rounds=1, participation=1.0), "method": "fedpft", "method_params": mp}
    torch.manual_seed(0)
    method = FedPFT(prompt_adapter(build_backbone("resnet8_pft_mini")), load_bundle(tiny_run_files["dataset"]).num_classes, mp)
    final = {"identity": identity("fedpft"), "server": method.strategy.init_state(4),
             "clients": {c: method.client.init_state(c) for c in range(4)}}
    path = tmp_path_factory.mktemp("pftprobe") / "final.pt"
    torch.save(final, path)
    run = load_trained_run(params, identity("fedpft"), tiny_run_files["dataset"], tiny_run_files["partition"],
                           "resnet8_pft_mini", None, path, device="cpu")
    return run, path, params


def test_rebuilt_run_has_the_clients_prompts_and_fedpft_feature_kinds(pft_run):
    from fedcore.analysis.linear_probe import feature_maps
    from fedcore.analysis.run_features import attention_weights

    run, path, _ = pft_run
    saved = torch.load(path, weights_only=False)
    m1 = run.client_model(1)
    assert torch.equal(m1.p_kappa.detach(), saved["clients"][1]["model"]["p_kappa"])
    m0 = run.client_model(0)
    assert not torch.equal(m0.p_kappa.detach(), saved["clients"][1]["model"]["p_kappa"])  # prompts are per client
    maps = feature_maps(m0)
    assert set(maps) == {"default", "phi", "none", "p_kappa", "p_rho"}
    f, y = run.apply(maps["p_rho"], "test", 0)
    assert f.shape == (len(run.test_idx[0]), m0.feature_dim) and len(y) == len(f)
    w, labels = attention_weights(run, 0, "p_kappa", 5)
    assert w.shape == (5, 1 + 3) and len(labels) == 5
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-5)
    assert attention_weights(run, 0, "p_rho", 3)[0].shape == (3, 1 + 2)


def test_probe_run_rows_and_the_rebuild_check(pft_run):
    run, _, _ = pft_run
    df = probe_run(run, identity("fedpft"), ProbeSettings(epochs=2), logged=None)
    got = set(zip(df["feature"], df["measure"]))
    assert got == {("default", "origin"), ("default", "match"), ("default", "probe"), ("phi", "probe"),
                   ("none", "probe"), ("p_kappa", "probe"), ("p_rho", "probe")}
    assert len(df) == 4 * len(got)
    probe = df[df.measure == "probe"].pivot(index="client", columns="feature", values="value")
    assert (probe["p_kappa"] == probe["default"]).all()
    assert df.loc[df.measure == "match", "value"].notna().all()  # FedPFT predicts h_κ(f'): the match layer applies
    origin = dict(zip(df.loc[df.measure == "origin", "client"], df.loc[df.measure == "origin", "value"]))
    n_test = {c: len(run.test_idx[c]) for c in origin}
    check_against_log(origin, origin, n_test, "run")
    with pytest.raises(ValueError, match="final.pt and metrics disagree"):
        check_against_log(origin, {c: a + 0.5 for c, a in origin.items()}, n_test, "run")


def test_probe_table_cells_statuses_and_seed_stats():
    rows = pd.DataFrame([
        {"experiment": "e", "method": m, "scale": "mini", "seed": s, "client": c, "feature": f, "measure": me, "value": v}
        for m, s, c, f, me, v in [
            ("fedpft", 0, 0, "default", "probe", 0.8), ("fedpft", 0, 1, "default", "probe", 0.6),
            ("fedpft", 1, 0, "default", "probe", 0.9), ("fedpft", 1, 1, "default", "probe", 0.9),
            ("fedpft", 0, 0, "none", "probe", 0.5), ("fedavg", 0, 0, "default", "match", math.nan)]])
    cfg = {"rows": ["fedpft", "fedavg", "ptype_none", "fedper", "nope"],
           "row_sources": {"ptype_none": {"method": "fedpft", "feature": "none"}},
           "columns": [{"label": "probe", "experiment": "e"}, {"label": "match", "experiment": "e", "measure": "match"}],
           "paper": {"fedpft": [77.25, None]}}
    exps = {"e": {"methods": ["fedpft", "fedavg"]}}
    t = build_probe_table(rows, cfg, exps, "mini", {"fedpft", "fedavg", "fedper"}).set_index(["row", "column"])
    assert t.loc[("fedpft", "probe"), "ours"] == pytest.approx(80.0)            # seeds 70 and 90
    assert t.loc[("fedpft", "probe"), "ours_std"] == pytest.approx(np.std([70, 90], ddof=1))
    assert t.loc[("fedpft", "probe"), "n_seeds"] == 2 and t.loc[("fedpft", "probe"), "paper"] == 77.25
    assert t.loc[("ptype_none", "probe"), "ours"] == pytest.approx(50.0)
    assert t.loc[("fedpft", "match"), "status"] == "missing metric"
    assert t.loc[("fedavg", "match"), "status"] == "missing metric"            # NaN (no head(feature) prediction)
    assert t.loc[("fedavg", "probe"), "status"] == "missing metric"
    assert t.loc[("fedper", "probe"), "status"] == "not configured"
    assert t.loc[("nope", "probe"), "status"] == "not implemented"
    assert not t["diverged"].any()  # probe CSVs without the column (written before it existed): none known


def test_a_probe_of_a_diverged_run_is_marked(tmp_path):
    """The probe job reads its run's metrics: a run with `diverged` rows writes diverged=True on every probe row,
    and the probe table marks the cell (! in the tables), as the metric tables do."""
    from fedcore.analysis.trained_run import run_diverged

    base = {"paper": "fedpft", "experiment": "e", "method": "fedpft", "scale": "mini", "dataset": "d", "seed": 0,
            "round": 1, "client": -1, "split": "train"}
    pd.DataFrame([{**base, "metric": "loss", "value": 1.0}]).to_parquet(tmp_path / "ok.parquet")
    pd.DataFrame([{**base, "metric": "loss", "value": math.nan},
                  {**base, "metric": "diverged", "value": 2.0}]).to_parquet(tmp_path / "bad.parquet")
    assert not run_diverged(tmp_path / "ok.parquet") and run_diverged(tmp_path / "bad.parquet")
    rows = pd.DataFrame([{"experiment": "e", "method": m, "scale": "mini", "seed": 0, "client": 0,
                          "feature": "default", "measure": "probe", "value": 0.5, "diverged": m == "fedpft"}
                         for m in ("fedpft", "fedavg")])
    cfg = {"rows": ["fedpft", "fedavg"], "columns": [{"label": "probe", "experiment": "e"}], "paper": {}}
    t = build_probe_table(rows, cfg, {"e": {"methods": ["fedpft", "fedavg"]}}, "mini", {"fedpft", "fedavg"})
    assert t["diverged"].tolist() == [True, False]


def test_probe_figures_draw_every_panel_or_say_why(tmp_path):
    from fedcore.analysis.probe_files import ATTENTION_FORMAT, RUN_TSNE_FORMAT, read_panels, save_panels
    from fedcore.report.fig_pft_probes import attention_figure, tsne_runs_figure
    from fedcore.report.plotting import figure_notes

    rng = np.random.default_rng(0)
    save_panels(tmp_path / "t.npz", {"emb_0": rng.normal(size=(12, 2)), "labels_0": np.arange(12) % 3,
                                     "clients_0": np.arange(12) % 2},
                {"format": RUN_TSNE_FORMAT, "panels": [{"label": "A", "method": "fedpft", "feature": "phi",
                                                        "status": "ok", "clients": 2},
                                                       {"label": "B", "method": "fedper", "feature": "phi",
                                                        "status": "not configured"}], "perplexity": 5, "seed": 0})
    fig = tsne_runs_figure(*read_panels(tmp_path / "t.npz", RUN_TSNE_FORMAT), {"caption": "Fig", "centroids": True})
    assert "fedper: not configured" in figure_notes(fig)
    w = rng.dirichlet(np.ones(4), size=5)
    save_panels(tmp_path / "a.npz", {"weights_0": w, "labels_0": np.zeros(5)},
                {"format": ATTENTION_FORMAT, "panels": [{"label": "p", "method": "fedpft", "prompts": "p_kappa",
                                                         "status": "ok"}], "client": 0, "samples": 5})
    fig = attention_figure(*read_panels(tmp_path / "a.npz", ATTENTION_FORMAT), {"caption": "Fig 6"})
    assert "client 0" in figure_notes(fig)
    with pytest.raises(ValueError, match="is not a"):
        read_panels(tmp_path / "a.npz", RUN_TSNE_FORMAT)
