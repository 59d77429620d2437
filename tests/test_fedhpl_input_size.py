"""FedHPL Fig. 10 (spec §7.2 N, Tables 7/8): an experiment's `input_size` feeds the same ResNets images of another side;
FedHPL (CNN)'s pad prompt is sized by it (1,260 pixels at 32 px, 8,172 at 224)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import edited_config, identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.backbones.vit import backbone_info
from fedcore.config import ConfigError, load_config
from fedcore.selection import figure_experiments
from fedcore.engine.data import InputPipeline
from fedcore.methods.fedhpl import FedHPL
from fedcore.report.fig_metrics import per_class_figure
from fedcore.report.plotting import figure_notes
from fedcore.train import train_run

ROOT = Path(__file__).resolve().parents[1]
TOP = {"scale": "mini", "seeds": [0], "papers": ["fedhpl"]}


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


@pytest.mark.parametrize("size, pad", [(32, 1260), (224, 8172)])
def test_pad_prompt_has_the_papers_count_and_the_model_runs(size, pad):
    """Table 8: prompt_lr 2·3·s·3 + prompt_tb 2·3·3·(s+6); torchvision ResNet-18 (random weights) on s-px images."""
    torch.manual_seed(0)
    net = build_backbone("resnet18", input_size=None if size == 224 else size)
    info = backbone_info(net)
    assert info["img_size"] == size
    model = FedHPL(prompt_adapter(net), 10, {}).model
    assert _count(model.pad) == pad == 2 * 3 * size * 3 + 2 * 3 * 3 * (size + 6)
    assert _count(model) == pad + 512 * 10 + 10                       # + the head (Table 8's sum)
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)  # CIFAR's own 32 px
    x = InputPipeline(info["img_size"], info["mean"], info["std"])(images)
    assert x.shape == (2, 3, size, size)                               # resized to 224 only without input_size
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, 10) and model.pad(x).shape == (2, 3, size + 6, size + 6)
    with pytest.raises(ValueError, match=f"expects {size}x{size} inputs"):
        model(torch.zeros(1, 3, size + 1, size + 1))


def test_only_resnets_take_another_input_size():
    with pytest.raises(ValueError, match=r"input_size=32 for backbone arch 'vit_mini'.*position embedding"):
        build_backbone("vit_mini", input_size=32)
    for bad in (0, 8.0, True):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            build_backbone("resnet_mini_18", input_size=bad)


def _hetero(files, out, **params):
    out.mkdir(exist_ok=True)
    archs = ["resnet_mini_18", "resnet_mini_34", "resnet_mini_50"]
    run = {**run_params(rounds=1, participation=1.0, batch_size=32), "client_backbones": [0, 1, 2, 1, 0], **params,
           "evaluation": {"global_test": "official_test", "per_class": True}}
    return train_run(run, identity("fedhpl"), files["dataset"], files["partition5"], archs,
                     [files["weights"][a] for a in archs], out / "m.parquet", out / "f.pt", progress=False,
                     device="cpu")


def test_a_run_at_another_input_size_pads_those_images(hetero_files, tmp_path):
    plain = _hetero(hetero_files, tmp_path / "plain")
    same = _hetero(hetero_files, tmp_path / "16", input_size=16)      # the weights' own size: nothing changes
    pd.testing.assert_frame_equal(plain.metrics, same.metrics)
    small = _hetero(hetero_files, tmp_path / "8", input_size=8)
    for c in range(5):
        assert small.personal_states[c]["pad.prompt_lr"].shape == (2, 3, 8, 3)
        assert small.personal_states[c]["pad.prompt_tb"].shape == (2, 3, 3, 14)
        assert plain.personal_states[c]["pad.prompt_lr"].shape == (2, 3, 16, 3)
    acc = lambda r: r.metrics.query("split == 'global' and metric == 'acc' and client == -1")["value"]  # noqa: E731
    assert acc(small).between(0, 1).all() and not acc(small).equals(acc(plain))


# ---- configuration ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg():
    return load_config(TOP, ROOT)


def test_the_32px_experiments_are_the_hetres_ones_at_their_own_size(cfg):
    for scale, size in (("paper", 32), ("mini", 8)):
        c = cfg.at_scale(scale)
        for setting in ("iid", "dir", "noniid"):
            name, base = f"hpl_c10_{setting}_hetres_32px", f"hpl_c10_{setting}_hetres"
            ours, theirs = c.train_params(name, "fedhpl"), c.train_params(base, "fedhpl")
            assert ours.pop("input_size") == size and "input_size" not in theirs
            assert ours == theirs                                          # the same run otherwise
            assert c.experiments[name]["client_backbones"] == c.experiments[base]["client_backbones"]
    fig = cfg.figures["fedhpl_fig10"]
    assert set(figure_experiments(fig)) == {f"hpl_c10_{s}_{m}" for s in ("iid", "dir", "noniid")
                                            for m in ("hetres", "hetres_32px", "hetvit")}


def test_table8_at_32px_counts_the_papers_sums(cfg):
    """Table 8's sum^32 (head + 1,260 pad pixels) from the 32-px experiment's input_size, exactly."""
    from fedcore.analysis.params import model_counts

    counts = [model_counts(m)["trainable"] for m in cfg.param_count_models("fedhpl_table8_32px")]
    assert counts == [5130 + 1260, 5130 + 1260, 20490 + 1260, 51300 + 1260, 51300 + 1260, 204900 + 1260]


def test_fig10_draws_each_input_size_from_its_experiment(cfg):
    rows = []
    for exp, level in (("hpl_c10_iid_hetres_32px", 0.3), ("hpl_c10_iid_hetres", 0.6), ("hpl_c10_iid_hetvit", 0.9)):
        rows += [{"paper": "fedhpl", "experiment": exp, "method": "fedhpl", "scale": "mini", "dataset": "digits",
                  "seed": 0, "round": 20, "client": -1, "split": "global", "metric": f"acc_class{k}",
                  "value": level} for k in range(10)]
    fig = per_class_figure(pd.DataFrame(rows), cfg.figures["fedhpl_fig10"], cfg.report_view(), "mini",
                           set(cfg.implemented_methods()))
    drawn = {line.get_label(): line.get_ydata().mean() for line in fig.axes[0].get_lines()}
    assert drawn == pytest.approx({"R8 (as R32)": 30.0, "R16 (as R224)": 60.0, "V16 (as V224)": 90.0})
    assert "Dir: R8 (as R32) (missing run)" in figure_notes(fig)


def _edited(tmp_path: Path, edit) -> Path:
    return edited_config(tmp_path, "fedhpl", edit)


@pytest.mark.parametrize("edit, message", [
    (lambda e: e["hpl_c10_iid_hetvit"].update(input_size=32),
     r"experiment 'hpl_c10_iid_hetvit', key 'input_size' = 32: allowed only with backbones of the families "
     r"\['resnet'\]; backbone 'vit_mini_s' is a vit"),
    (lambda e: e["hpl_c10_iid_hetres_32px"].update(input_size=0),
     r"hpl_c10_iid_hetres_32px\.input_size: 0 is less than the minimum of 1"),
    (lambda e: e["hpl_c10_iid_hetres_32px"].update(input_size="32"),
     r"hpl_c10_iid_hetres_32px\.input_size: '32' is not of type 'integer'"),
])
def test_bad_input_sizes_are_named(tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TOP, _edited(tmp_path, edit))


def test_a_method_with_its_own_backbone_cannot_take_an_input_size(tmp_path):
    def edit(e):
        e["hpl_c10_iid_hetres_32px"]["methods"] = ["fedhpl", "pfedpt"]

    with pytest.raises(ConfigError, match=r"'input_size' = 8: method 'pfedpt' trains its own backbone "
                                          r"'vit_pfedpt'"):
        load_config(TOP, _edited(tmp_path, edit))
