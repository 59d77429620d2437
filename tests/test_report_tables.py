"""SGPT Tables 2-4 and the report configuration: layouts, paper numbers, labels, scale overrides, errors."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedcore.config import ConfigError, load_config
from fedcore.report.tables import MISSING_RUN, OK, build_table, render_latex, render_markdown

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = {**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "papers": ["sgpt"], "outputs": "all"}


@pytest.fixture(scope="module")
def mini():
    return load_config(DEFAULT, ROOT)


@pytest.fixture(scope="module")
def paper():
    return load_config({**DEFAULT, "scale": "paper"}, ROOT)


def metric_rows(experiment: str, method: str, values: dict[tuple[int, str, str], float], rounds: int = 10,
                scale: str = "mini", seed: int = 0) -> pd.DataFrame:
    """Constant values per round for keys (client, split, metric)."""
    rows = [{"paper": "sgpt", "experiment": experiment, "method": method, "scale": scale, "dataset": "d",
             "seed": seed, "round": r, "client": c, "split": s, "metric": m, "value": v}
            for r in range(1, rounds + 1) for (c, s, m), v in values.items()]
    return pd.DataFrame(rows).astype({"seed": "int64", "round": "int64", "client": "int64", "value": "float64"})


# ----------------------------------------------------------------------------------------------
# The report config as resolved
# ----------------------------------------------------------------------------------------------

def test_every_paper_table_and_figure_is_configured(mini):
    paper_tables = {f"sgpt_table{i}" for i in range(1, 6)}
    assert paper_tables <= set(mini.tables)
    # any other table compares methods outside the paper (README, Adding an experiment): no paper numbers
    assert all(not mini.tables[t].get("paper") for t in set(mini.tables) - paper_tables)
    assert set(mini.figures) == {"sgpt_accuracy_per_round", "sgpt_fig1", "sgpt_fig3", "sgpt_fig4", "sgpt_fig5",
                                 "sgpt_fig6a", "sgpt_fig6b", "sgpt_fig7"}
    assert mini.tables["sgpt_table1"]["rows"] == ["head_tune", "fedvpt", "fedvpt_d", "fedmix", "pfedpg", "fedem",
                                                  "fedpr", "sgpt", "sgpt_code2024"]
    assert mini.tables["sgpt_table1"]["paper"]["sgpt"][1] == 84.64


def test_table2_columns_are_domains_then_average(mini):
    cols = mini.tables["sgpt_table2"]["columns"]
    assert [c.get("client") for c in cols[:5]] == [0, 1, 2, 3, None] and cols[4]["metric"] == "local_acc"
    assert [c["label"] for c in cols[5:]] == ["DN C", "DN I", "DN P", "DN Q", "DN R", "DN S", "DN Avg."]
    assert mini.tables["sgpt_table2"]["paper"]["sgpt"][-1] == 80.48


def test_row_labels_from_report_then_variants(mini):
    t1 = mini.tables["sgpt_table1"]["row_labels"]
    assert t1["fedvpt_d"] == "FedVPT-D" and t1["sgpt"] == "SGPT (ours)"
    assert mini.tables["sgpt_table4"]["row_labels"]["sgpt_qg"] == "w/ q_g"  # the table's own label wins
    assert mini.figures["sgpt_fig6a"]["labels"]["sgpt_ak0p9"] == mini.variants["sgpt_ak0p9"]["label"]


def test_implemented_counts_variants(mini):
    implemented = set(mini.implemented_methods())
    assert {"sgpt", "sgpt_qg", "sgpt_share_only"} <= implemented


def test_scale_overrides_fig4_and_fig5(mini, paper):
    def points(cfg):
        return [[p["value"] for p in s["points"]] for s in cfg.figures["sgpt_fig4"]["series"]]

    assert points(mini) == [[0, 1, 2, 3], [1, 2, 3]]
    assert points(paper) == [list(range(12)), list(range(4, 12))]
    assert mini.figures["sgpt_fig5"]["blocks"] == [0, 1, 2, 3] and paper.figures["sgpt_fig5"]["blocks"] == [0, 2, 5, 8, 11]
    assert paper.figures["sgpt_fig5"]["per_class"] == 100


def test_param_models_use_paper_scale_params_at_every_scale(mini):
    models = mini.param_count_models("sgpt_table5")
    assert [m["source"] for m in models] == ["torchvision", "torchvision", "timm", "method"]
    sgpt = models[3]
    assert sgpt["arch"] == "vit_base_patch16_224" and sgpt["params"]["groups"] == 20
    assert sgpt["params"]["group_blocks"] == [4, 5, 6]  # sgpt_c100_s10 at paper scale, not vit_mini's


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "config", tmp_path / "config")
    return tmp_path


def _edit(path: Path, edit) -> None:
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))


def test_unknown_override_name_is_an_error(tmp_path: Path):
    root = _copy(tmp_path)
    _edit(root / "config" / "scales" / "mini" / "sgpt.yaml", lambda d: d["figures"].update(sgpt_fig99={"blocks": [0]}))
    with pytest.raises(ConfigError, match=r"mini/sgpt.yaml at figures: 'sgpt_fig99' is not one of"):
        load_config(DEFAULT, root)


def test_bad_override_value_is_validated(tmp_path: Path):
    root = _copy(tmp_path)
    _edit(root / "config" / "scales" / "mini" / "sgpt.yaml", lambda d: d["figures"]["sgpt_fig5"].update(per_class="many"))
    with pytest.raises(ConfigError, match=r"figure sgpt_fig5\) after .*mini/sgpt.yaml at per_class"):
        load_config(DEFAULT, root)


def test_figure_method_typo_is_an_error(tmp_path: Path):
    root = _copy(tmp_path)
    _edit(root / "config" / "reports" / "sgpt.yaml",
          lambda d: d["figures"]["sgpt_fig3"]["panels"].append({"label": "(c)", "method": "sgtp"}))
    with pytest.raises(ConfigError, match=r"'sgtp' is not one of"):
        load_config(DEFAULT, root)


def test_table_row_typo_and_attribute_length_are_errors(tmp_path: Path):
    root = _copy(tmp_path)
    path = root / "config" / "reports" / "sgpt.yaml"
    original = path.read_text()
    _edit(path, lambda d: d["tables"]["sgpt_table3"]["row_attributes"]["values"]["sgpt"].pop())
    with pytest.raises(ConfigError, match=r"row_attributes.values.sgpt: 3 values for 4 columns"):
        load_config(DEFAULT, root)
    path.write_text(original)
    _edit(path, lambda d: d["tables"]["sgpt_table4"]["rows"].append("sgpt_q"))
    with pytest.raises(ConfigError, match=r"rows\[3\]: 'sgpt_q' is not one of"):
        load_config(DEFAULT, root)


def test_unknown_figure_kind_names_allowed_kinds(tmp_path: Path):
    root = _copy(tmp_path)
    _edit(root / "config" / "reports" / "sgpt.yaml", lambda d: d["figures"]["sgpt_fig7"].update(kind="pie"))
    with pytest.raises(ConfigError, match=r"'pie' is not one of \['accuracy_per_round', 'scatter'"):
        load_config(DEFAULT, root)


# ----------------------------------------------------------------------------------------------
# Tables 2-4 from synthetic metrics
# ----------------------------------------------------------------------------------------------

def test_table2_client_columns_and_average(mini):
    view = mini.report_view()
    values = {(-1, "local", "acc_mean"): 0.9, **{(c, "local", "acc"): 0.8 + 0.05 * c for c in range(4)}}
    metrics = metric_rows("sgpt_office", "sgpt", values, rounds=3)  # mini runs 10 rounds
    table = build_table(metrics, mini.tables["sgpt_table2"], view, "mini", set(mini.implemented_methods()))
    sgpt = table.loc[table["row"] == "sgpt"].set_index("column")
    assert sgpt.loc["Off A", "ours"] == pytest.approx(80.0) and sgpt.loc["Off W", "ours"] == pytest.approx(95.0)
    assert sgpt.loc["Off Avg.", "ours"] == pytest.approx(90.0) and sgpt.loc["Off Avg.", "paper"] == 97.72
    assert sgpt.loc["DN C", "status"] == MISSING_RUN
    # the run ends at round 3, before the experiment's configured rounds: marked incomplete (‡)
    assert view["sgpt_office"]["rounds"] > 3 and bool(sgpt.loc["Off A", "incomplete"])


def test_table3_checkmarks_and_table4_cluster_metric(mini):
    view = mini.report_view()
    impl = set(mini.implemented_methods())
    metrics = pd.concat([
        metric_rows("sgpt_c100_s10", "sgpt", {(-1, "global", "acc"): 0.8, (-1, "local", "acc_worst"): 0.7,
                                              (-1, "global", "select_cluster_acc"): 0.55}),
        metric_rows("sgpt_c100_s10", "sgpt_keys_fedavg", {(-1, "global", "acc"): 0.6,
                                                          (-1, "global", "select_cluster_acc"): 0.2}),
    ], ignore_index=True)
    t3 = build_table(metrics, mini.tables["sgpt_table3"], view, "mini", impl)
    md = render_markdown(t3, mini.tables["sgpt_table3"], "mini")
    assert "| Method | Share | Group | BCD-Inv | BCD | Global: ours |" in md
    assert "| Share only | ✓ |  |  |  | missing run |" in md
    assert "| Share + Group, BCD (SGPT) | ✓ | ✓ |  | ✓ | **80.00** |" in md
    tex = render_latex(t3, mini.tables["sgpt_table3"], "mini")
    assert r"$\checkmark$" in tex and r"\cmidrule(lr){6-7}" in tex
    t4 = build_table(metrics, mini.tables["sgpt_table4"], view, "mini", impl)
    s10 = t4.loc[t4["column"] == "CIFAR-100 s=10"].set_index("row")
    assert s10.loc["sgpt", "ours"] == pytest.approx(55.0) and s10.loc["sgpt", "paper"] == 56.62
    assert s10.loc["sgpt_keys_fedavg", "ours"] == pytest.approx(20.0)
    assert s10.loc["sgpt_qg", "status"] == MISSING_RUN and math.isnan(s10.loc["sgpt_qg", "ours"])
    s50 = t4.loc[t4["column"] == "CIFAR-100 s=50"]
    assert (s50["status"] == MISSING_RUN).all()
    assert (t4.loc[t4["status"] == OK, "metric"] == "select_cluster_acc").all()


# ----------------------------------------------------------------------------------------------
# Fixed-round columns and non-% units (FedHPL Tables 9, 10)
# ----------------------------------------------------------------------------------------------

def _comm_metrics() -> pd.DataFrame:
    """Round r: total r * 2^20 numbers sent, mean per client r * 1000."""
    rows = [{"paper": "sgpt", "experiment": "e", "method": "m", "scale": "paper", "dataset": "d", "seed": 0,
             "round": r, "client": -1, "split": "train", "metric": name, "value": v}
            for r in range(1, 6)
            for name, v in (("upload_numbers_total", r * 2.0 ** 20), ("upload_numbers_mean", r * 1000.0))]
    return pd.DataFrame(rows).astype({"seed": "int64", "round": "int64", "client": "int64", "value": "float64"})


def _comm_table(columns: list[dict], **extra) -> dict:
    return {"caption": "comm", "rows": ["m"], "columns": columns, "paper": {"m": [1.0] * len(columns)}, **extra}


def test_fixed_round_columns_read_one_round_in_the_metrics_unit():
    exps = {"e": {"methods": ["m"], "report": {"window": "last", "rounds": 3}, "rounds": 5}}
    cols = [{"label": "first", "experiment": "e", "metric": "upload_total_M", "round": "first"},
            {"label": "last", "experiment": "e", "metric": "upload_total_M", "round": "last"},
            {"label": "r2", "experiment": "e", "metric": "upload_total_M", "round": 2},
            {"label": "r9", "experiment": "e", "metric": "upload_total_M", "round": 9},
            {"label": "window", "experiment": "e", "metric": "upload_numbers"}]
    t = build_table(_comm_metrics(), _comm_table(cols), exps, "paper", {"m"})
    assert t["ours"].iloc[:3].tolist() == [1.0, 5.0, 2.0]                  # M = 2^20 numbers, not %
    assert t["status"].iloc[3] == "missing metric" and math.isnan(t["ours"].iloc[3])  # the run has no round 9
    assert t["ours"].iloc[4] == pytest.approx(4000.0)                        # mean of the last 3 rounds, unit 1
    assert t["window"].tolist()[:3] == ["first round", "final round", "round 2"]
    assert t["diff"].iloc[:3].tolist() == [0.0, 4.0, 1.0]
    md = render_markdown(t, _comm_table(cols, decimals=3, best="none"), "paper")
    assert "1.000" in md and "5.000" in md and "**" not in md.split("\n", 2)[2]   # no bold cell
    assert "value at the first round" in md and "in the table's units" in md
    with pytest.raises(ValueError, match="round 0"):
        build_table(_comm_metrics(), _comm_table([{**cols[0], "round": 0}]), exps, "paper", {"m"})


def test_best_min_bolds_the_lowest():
    exps = {"e": {"methods": ["m", "n"], "report": {"window": "last", "rounds": 1}}}
    metrics = pd.concat([_comm_metrics(), _comm_metrics().assign(method="n", value=lambda d: d.value * 2)])
    cfg = {"caption": "c", "rows": ["m", "n"], "columns": [{"label": "x", "experiment": "e",
                                                             "metric": "upload_numbers"}], "paper": {}, "best": "min"}
    md = render_markdown(build_table(metrics, cfg, exps, "paper", {"m", "n"}), cfg, "paper")
    assert "**5000.00**" in md and "**10000.00**" not in md and "(the lowest)" in md


def test_cells_counting_never_sampled_clients_are_marked():
    """A personalised run whose window aggregate still counts never-sampled clients (pFedPG at low participation):
    the cell carries § and the table says what it means; a window after every client trained does not."""
    exps = {"e": {"methods": ["m"], "report": {"window": "last", "rounds": 2}, "rounds": 10},
            "f": {"methods": ["m"], "report": {"window": "last", "rounds": 2}, "rounds": 10}}
    acc = {(-1, "local", "acc_mean"): 0.5}
    early = metric_rows("e", "m", {**acc, (-1, "local", "untrained_clients"): 3.0})
    late = metric_rows("f", "m", acc)
    late = pd.concat([late, metric_rows("f", "m", {(-1, "local", "untrained_clients"): 0.0})])
    cfg = {"caption": "c", "rows": ["m"], "columns": [{"label": "e", "experiment": "e", "metric": "local_acc"},
                                                       {"label": "f", "experiment": "f", "metric": "local_acc"}],
           "paper": {}}
    t = build_table(pd.concat([early, late]), cfg, exps, "mini", {"m"})
    assert t["untrained"].tolist() == [True, False]
    md = render_markdown(t, cfg, "mini")
    assert "50.00§" in md and "never sampled" in md
    assert r"\S{}" in render_latex(t, cfg, "mini")


def test_numbers_of_a_run_that_diverged_are_marked():
    """A run whose trained state went NaN/inf at some round (the engine's `diverged` rows) still scores a number,
    often chance level: every cell it feeds carries ! and the table says what it means; a healthy run does not."""
    exps = {"e": {"methods": ["m", "n"], "report": {"window": "last", "rounds": 1}, "rounds": 10}}
    acc = {(-1, "local", "acc_mean"): 0.1}
    metrics = pd.concat([metric_rows("e", "m", {**acc, (-1, "train", "diverged"): 2.0}),
                         metric_rows("e", "n", acc)])
    cfg = {"caption": "c", "rows": ["m", "n"], "columns": [{"label": "e", "experiment": "e", "metric": "local_acc"}],
           "paper": {}, "best": "none"}
    t = build_table(metrics, cfg, exps, "mini", {"m", "n"})
    assert t["diverged"].tolist() == [True, False]
    md = render_markdown(t, cfg, "mini")
    assert "| 10.00! |" in md and "| 10.00 |" in md and "held NaN or inf" in md
    assert "10.00!" in render_latex(t, cfg, "mini")


def test_a_method_with_its_own_shorter_budget_is_not_incomplete():
    """Zero-shot CLIP runs one round (method_federation) in a 10-round experiment: complete, not ‡."""
    exps = {"e": {"methods": ["m", "z"], "report": {"window": "last", "rounds": 1}, "rounds": 10,
                  "method_rounds": {"z": 1}}}
    acc = {(-1, "local", "acc_mean"): 0.5}
    metrics = pd.concat([metric_rows("e", "m", acc, rounds=10), metric_rows("e", "z", acc, rounds=1),
                         metric_rows("e", "m", acc, rounds=3).assign(method="short")])
    exps["e"]["methods"].append("short")
    cfg = {"caption": "c", "rows": ["m", "z", "short"],
           "columns": [{"label": "e", "experiment": "e", "metric": "local_acc"}], "paper": {}}
    t = build_table(metrics, cfg, exps, "mini", {"m", "z", "short"})
    assert t["incomplete"].tolist() == [False, False, True]


def test_report_view_carries_method_budgets():
    view = load_config({**DEFAULT, "papers": ["fedotp"]}, ROOT).report_view()["otp_office_feature"]
    assert view["method_rounds"] == {"zs_clip": 1}        # every other method runs the experiment's rounds


def test_client_list_columns_give_mean_and_std_over_those_clients():
    """FedOTP Table A3: a column over a domain's clients shows their mean ± std (ddof 0) of each client's accuracy
    averaged over seeds; a listed client without a value leaves the cell empty, never a mean over fewer."""
    exps = {"e": {"methods": ["m"], "report": {"window": "last", "rounds": 1}, "rounds": 10}}
    metrics = pd.concat([metric_rows("e", "m", {(0, "local", "acc"): 0.2, (1, "local", "acc"): 0.4,
                                                (2, "local", "acc"): 0.9}, seed=0),
                         metric_rows("e", "m", {(0, "local", "acc"): 0.4, (1, "local", "acc"): 0.4,
                                                (2, "local", "acc"): 0.9}, seed=1)])
    cols = [{"label": "A", "experiment": "e", "metric": "client_acc", "clients": [0, 1]},
            {"label": "Avg.", "experiment": "e", "metric": "client_acc", "clients": [0, 1, 2]},
            {"label": "gap", "experiment": "e", "metric": "client_acc", "clients": [2, 3]},
            {"label": "one", "experiment": "e", "metric": "client_acc", "client": 2}]
    cfg = {"caption": "c", "rows": ["m"], "columns": cols, "paper": {}}
    t = build_table(metrics, cfg, exps, "mini", {"m"})
    assert t["ours"].iloc[0] == pytest.approx(35.0) and t["ours_std"].iloc[0] == pytest.approx(5.0)
    assert t["ours"].iloc[1] == pytest.approx(160.0 / 3)
    assert t["ours_std"].iloc[1] == pytest.approx(pd.Series([30.0, 40.0, 90.0]).std(ddof=0))
    assert t["status"].iloc[2] == "missing metric" and math.isnan(t["ours"].iloc[2])
    assert t["std_over"].tolist() == ["clients", "clients", "clients", "seeds"] and t["n_seeds"].iloc[0] == 2
    md = render_markdown(t, cfg, "mini")
    assert "35.00 ± 5.00" in md and "Columns A, Avg., gap: mean ± std over the column's clients" in md
    with pytest.raises(ValueError, match="not both"):
        build_table(metrics, {**cfg, "columns": [{**cols[0], "client": 0}]}, exps, "mini", {"m"})


def test_cells_on_a_dataset_built_from_image_folders_are_marked(tmp_path):
    """allow_folder_layout: the table reads the bundles' meta and marks cells of experiments whose dataset came
    from image folders (our own split) with ¶ and a note; a bundle from the pickles leaves its cells unmarked."""
    import numpy as np

    from fedcore.data.arrays import ArrayDataset, DatasetBundle, save_bundle
    from fedcore.report.render import mark_folder_layout

    def bundle(name, folder):
        ds = ArrayDataset(x=np.zeros((2, 2, 2, 3), np.uint8), y=np.zeros(2, np.int64))
        save_bundle(DatasetBundle(train=ds, test=ds, meta={"name": name, "folder_layout": folder}),
                    tmp_path / f"{name}.npz")
        return str(tmp_path / f"{name}.npz")

    exps = {e: {"methods": ["m"], "report": {"window": "last", "rounds": 1}, "rounds": 10, "dataset": d}
            for e, d in (("off", "office_caltech10"), ("dn", "domainnet"))}
    marked = mark_folder_layout(exps, [bundle("office_caltech10", True), bundle("domainnet", False)])
    assert marked["off"]["folder_layout"] and not marked["dn"]["folder_layout"]
    assert mark_folder_layout(exps, []) is exps
    metrics = pd.concat([metric_rows(e, "m", {(-1, "local", "acc_mean"): 0.5}) for e in exps])
    cfg = {"caption": "c", "rows": ["m"], "paper": {},
           "columns": [{"label": e, "experiment": e, "metric": "local_acc"} for e in exps]}
    t = build_table(metrics, cfg, marked, "mini", {"m"})
    assert t["folder_layout"].tolist() == [True, False]
    md = render_markdown(t, cfg, "mini")
    assert md.count("50.00¶") == 1 and "image folders" in md
    assert r"\P{}" in render_latex(t, cfg, "mini")
