"""FedHPL's configuration: a paper's scale file stays its own, per-method budgets, per-run cluster requests, the
paper-scale run list, table rows read from other experiments."""
from __future__ import annotations

import collections
from pathlib import Path

import pandas as pd
import pytest

from fedcore.config import ConfigError, load_config
from fedcore.code_inputs import code_files
from fedcore.methods import method_module
from fedcore.report.tables import build_table

ROOT = Path(__file__).resolve().parents[1]
TOP = {"scale": "mini", "seeds": [0]}


@pytest.fixture(scope="module")
def both():
    return load_config({**TOP, "papers": ["sgpt", "fedhpl"]}, ROOT)


def test_each_paper_loads_alone_and_together_with_the_same_runs(both):
    alone = {p: load_config({**TOP, "papers": [p]}, ROOT) for p in ("sgpt", "fedhpl")}
    key = lambda r: (r["experiment"], r["method"])  # noqa: E731
    assert sorted(map(key, both.runs())) == sorted(map(key, alone["sgpt"].runs() + alone["fedhpl"].runs()))
    assert set(both.variants) == set(alone["sgpt"].variants) | set(alone["fedhpl"].variants)
    # a paper's scale file changes only its own experiments: SGPT's cifar100 stays digits, FedHPL's is digits_five
    assert both.experiments["sgpt_c100_s10"]["dataset"] == "digits"
    assert both.experiments["hpl_c100_iid_homo"]["dataset"] == "digits_five"


def test_paper_scale_lists_every_run_group(both):
    paper = both.at_scale("paper")
    runs = [r for r in paper.runs() if paper.experiments[r["experiment"]]["paper"] == "fedhpl"]
    # 261 + Fig. 3(b)'s shares 8 + Fig. 10's 32-px runs 3 + Table 3(e)'s +P, +H 12 + Tables 12, 13's MoCo runs 36
    # (Local on CIFAR-10 only, where Table 3(e) and Fig. 3(c) read it)
    assert len(runs) == 320
    by_method = collections.Counter(paper.base_method(r["method"]) for r in runs)
    assert by_method["fedhpl"] == 167 and by_method["fedgen"] == 18 and by_method["fedavg"] == 9
    # Table 1: 8 methods x 9 cells on homo; Table 2: 7 methods on hetres + FedHPL (ViT) on hetvit
    homo = {r["method"] for r in runs if r["experiment"] == "hpl_c10_iid_homo"}
    assert {"fedavg", "fedprox", "scaffold", "fedbabu", "fedrep", "pfedpt", "pfedpg", "fedhpl"} <= homo


def test_method_budgets_override_the_experiment(both):
    paper = both.at_scale("paper")
    assert paper.train_params("hpl_c10_iid_homo", "fedhpl")["federation"]["rounds"] == 10
    assert paper.train_params("hpl_c10_iid_homo", "fedavg")["federation"]["rounds"] == 100
    assert paper.train_params("hpl_c100_iid_hetres", "fedhpl")["federation"]["rounds"] == 100   # FedHPL (CNN)
    assert paper.train_params("hpl_c10_a0p1_homo", "hpl_tc3")["federation"]["local_epochs"] == 3
    assert both.train_params("hpl_c10_iid_homo", "fedavg")["federation"]["rounds"] == 20        # mini's cut


def test_vit_l_runs_ask_for_more_memory_and_time_than_vit_s(both):
    paper = both.at_scale("paper")
    hetvit = paper.run_resources("hpl_c10_iid_hetvit", "fedhpl")
    small = paper.run_resources("hpl_c10_iid_homo", "fedhpl")   # ViT-B only
    assert hetvit["gpu"] == small["gpu"] == 1
    assert hetvit["mem_mb"] > small["mem_mb"] and hetvit["runtime"] > small["runtime"]
    assert both.run_resources("hpl_c10_iid_hetvit", "fedhpl")["gpu"] == 0


def test_a_budget_shorter_than_the_report_window_is_refused(tmp_path):
    import shutil

    import yaml

    shutil.copytree(ROOT / "config", tmp_path / "config")
    path = tmp_path / "config" / "scales" / "mini" / "fedhpl.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["experiments"]["hpl_c10_iid_homo"]["report"] = {"window": "last", "rounds": 15}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"report.rounds=15 exceeds"):
        load_config({**TOP, "papers": ["fedhpl"]}, tmp_path)


def test_a_row_source_reads_another_method_in_another_experiment(both):
    table = both.tables["fedhpl_table2"]
    rows = []
    for exp, method, value in (("hpl_c10_iid_hetres", "fedhpl", 0.5), ("hpl_c10_iid_hetvit", "fedhpl", 0.75)):
        rows.append({"paper": "fedhpl", "experiment": exp, "method": method, "scale": "mini", "dataset": "digits",
                     "seed": 0, "round": 10, "client": -1, "split": "global", "metric": "acc", "value": value})
    out = build_table(pd.DataFrame(rows), table, both.report_view(), "mini", set(both.implemented_methods()))
    cell = out[(out.column == "C10 IID")].set_index("row")
    assert cell.loc["fedhpl", "ours"] == 50.0 and cell.loc["hpl_vit", "ours"] == 75.0
    assert cell.loc["hpl_vit", "experiment"] == "hpl_c10_iid_hetvit"


def test_a_method_reruns_when_a_method_module_it_builds_on_changes():
    names = {p.name for p in code_files(method_module("fedgen")) if p.parts[0] == "methods"}
    assert names == {"__init__.py", "base.py", "fedgen.py", "global_head.py"}


def test_parameter_tables_count_the_papers_models_exactly(both):
    """Spec §9's exact counts through the param_counts probe's path (meta device, paper-scale params)."""
    from fedcore.analysis.params import model_counts

    def counts(table):
        return [model_counts(m)["trainable"] for m in both.param_count_models(table)]

    assert counts("fedhpl_table6") == [5002, 9994, 13322, 17674, 35338, 83978]      # shallow / deep, n = 3
    assert counts("fedhpl_table8") == [13302, 13302, 28662, 59472, 59472, 213072]    # 8,172 pad pixels + head
    assert counts("fedhpl_table5")[:3] == [21_669_514, 85_806_346, 303_311_882]     # entire ViT-S/B/L + head
    # Table 7, FedHPL (224 px): the entire ResNet-18/34/50 + head + 8,172 pad pixels, 10 and 100 classes; the
    # paper's M = 2^20 at 3 decimals (10.671 / 20.311 / 22.446 / 10.715 / 20.355 / 22.622) rounds these
    totals = [model_counts(m)["total"] for m in both.param_count_models("fedhpl_table7")]
    hpl, hpl32 = totals[-12:-6], totals[-6:]
    assert hpl == [11_189_814, 21_297_974, 23_536_694, 11_235_984, 21_344_144, 23_721_104]
    assert [a - b for a, b in zip(hpl, hpl32)] == [8172 - 1260] * 6                   # the pad at 224 vs 32 px
    assert [round(t / 2 ** 20, 3) for t in hpl32] == [10.665, 20.305, 22.44, 10.709, 20.349, 22.616]
    assert [round(t / 2 ** 20, 3) for t in hpl] == [10.671, 20.311, 22.446, 10.715, 20.355, 22.622]
    assert totals[0] == 11_176_512 + 512 * 10 + 10                                     # FedGen R18: 10.664 M
    # FedGen and FedTGP pool ResNet-50's features to 512 (HtFLlib's models): their rows are the paper's exactly
    paper_gen = [10.664, 20.304, 22.424, 10.708, 20.348, 22.468]
    assert [round(t / 2 ** 20, 3) for t in totals[:6]] == paper_gen                    # FedGen
    assert [round(t / 2 ** 20, 3) for t in totals[18:24]] == paper_gen                 # FedTGP


def test_per_class_figure_draws_each_run_and_lists_the_missing(both, tmp_path):
    from fedcore.report.fig_metrics import class_accuracy, per_class_figure
    from fedcore.report.plotting import figure_notes

    rows = []
    for rnd, scale in ((9, 0.5), (10, 1.0)):          # only the last round counts
        for k in range(10):
            rows.append({"paper": "fedhpl", "experiment": "hpl_c10_iid_homo", "method": "fedhpl", "scale": "mini",
                         "dataset": "digits", "seed": 0, "round": rnd, "client": -1, "split": "global",
                         "metric": f"acc_class{k}", "value": scale * k / 10})
    metrics = pd.DataFrame(rows)
    view, implemented = both.report_view(), set(both.implemented_methods())
    per, status = class_accuracy(metrics, "hpl_c10_iid_homo", view["hpl_c10_iid_homo"], "fedhpl", "mini",
                                 implemented)
    assert status == "ok" and list(per.index) == list(range(10)) and per[9] == pytest.approx(90.0)
    fig = per_class_figure(metrics, both.figures["fedhpl_fig5"], view, "mini", implemented)
    notes = figure_notes(fig)
    assert "CIFAR10-IID: FedAvg" in notes and "missing run" in notes      # configured, not run here
    assert "CIFAR100-IID: FedAvg" in notes and "not configured" in notes  # not run at mini


def test_bars_figure_draws_table_cells_and_marks_the_missing(both):
    from fedcore.report.fig_metrics import bars_figure
    from fedcore.report.plotting import figure_notes

    rows = [{"paper": "fedhpl", "experiment": "hpl_c10_iid_hetvit", "method": m, "scale": "mini", "dataset": "digits",
             "seed": 0, "round": 10, "client": -1, "split": "global", "metric": "acc", "value": v}
            for m, v in (("fedhpl", 0.9), ("hpl_local", 0.8))]
    fig = bars_figure(pd.DataFrame(rows), both.figures["fedhpl_fig3c"], both.report_view(), "mini",
                      set(both.implemented_methods()))
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches)
    assert heights == [80.0, 90.0]
    notes = figure_notes(fig)
    assert "IID: average aggregation (beta = 1)" in notes and "Dir: FedHPL" in notes


def test_table3e_plus_p_and_plus_h_run_in_its_six_cells_at_both_scales(both):
    cells = {f"hpl_c10_{p}_{m}" for p in ("iid", "dir", "noniid") for m in ("homo", "hetvit")}
    for cfg in (both, both.at_scale("paper")):
        for variant, share in (("hpl_plus_p", "prompts"), ("hpl_plus_h", "head")):
            runs = {r["experiment"] for r in cfg.runs() if r["method"] == variant}
            assert runs == cells
            assert all(cfg.train_params(e, variant)["method_params"]["share"] == share for e in cells)
