"""Engine roles: a strategy with non-tensor uplinks, heterogeneous backbones, complete client state (BatchNorm
buffers, a persistent optimiser) through checkpoints, and clients trained together for a CNN with BatchNorm."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedcore.engine.loop as loop
import fedcore.train
from conftest import identity, run_params
from fedcore.engine.optim import run_epochs
from fedcore.engine.roles import Client, Method, Strategy, state_keys
from fedcore.methods.base import BatchableClient, EveryClient, PersonalEvaluator, PromptMethod
from fedcore.train import train_run

C = 4  # classes of the synthetic bundle


# ---- a FedHPL-like toy: clients of different widths exchange per-class logits only -----------------
class LogitClient(Client):
    """Keeps its whole model; distils towards the downlink's per-class logits; uploads per-class sums + counts."""

    def personal_keys(self, keys):
        return list(keys)

    def shared_keys(self, keys):
        return []

    def train(self, model, cid, state, downlink, data, settings):
        teacher = downlink.get("class_logits")

        def loss_fn(b):
            logits = model(b.x)
            loss = F.cross_entropy(logits, b.y)
            if teacher is not None:
                loss = loss + F.kl_div(F.log_softmax(logits, 1), F.softmax(teacher[b.y], 1), reduction="batchmean")
            return loss

        named = dict(model.named_parameters())
        return run_epochs([named[k] for k in self.method.trainable_keys(cid)], data, settings,
                          settings.local_epochs, loss_fn)[0], None

    @torch.no_grad()
    def upload(self, model, cid, data, stats):
        sums, counts = torch.zeros(C, C), torch.zeros(C)
        for b in data.batches():
            sums.index_add_(0, b.y, model(b.x))
            counts += torch.bincount(b.y, minlength=C)
        return {"logit_sums": sums, "counts": counts, "width": model.head.in_features}


class LogitServer(EveryClient):
    def init_state(self, num_clients):
        return {"class_logits": None, "widths": {}}

    def configure(self, state, cid):
        return {"class_logits": state["class_logits"]}

    def aggregate(self, info, state, results):
        sums = sum(r.uplink["logit_sums"] for r in results)
        counts = sum(r.uplink["counts"] for r in results)
        widths = {**state["widths"], **{r.cid: r.uplink["width"] for r in results}}
        return {"class_logits": sums / counts.clamp(min=1)[:, None], "widths": widths}


class LogitShare(PromptMethod):
    name = "logit_share"
    prompt_mode = "shallow"
    defaults = {"num_prompts": 1}
    client_role = LogitClient
    strategy_role = LogitServer
    evaluator_role = PersonalEvaluator


@pytest.fixture
def two_widths(tiny_run_files, tmp_path):
    """The registry's narrower tiny ViT (vit_mini_s, dim 32) beside vit_mini (dim 64), random weights."""
    from fedcore.backbones.registry import build_backbone

    torch.manual_seed(1)
    torch.save(build_backbone("vit_mini_s").state_dict(), tmp_path / "narrow.pt")
    return {**tiny_run_files, "narrow": tmp_path / "narrow.pt"}


def _hetero(files, out, monkeypatch, stop=None):
    monkeypatch.setattr(fedcore.train, "method_class", lambda name: LogitShare)
    params = {**run_params(rounds=3, participation=1.0), "client_backbones": [0, 1, 0, 1]}
    out.mkdir(exist_ok=True)
    return train_run(params, identity("logit_share"), files["dataset"], files["partition"],
                     ["vit_mini", "vit_mini_s"], [files["weights"], files["narrow"]], out / "m.parquet",
                     out / "f.pt", checkpoint_path=out / "ckpt.pt", progress=False, stop_after_round=stop)


def test_heterogeneous_clients_exchange_only_logits(two_widths, tmp_path, monkeypatch):
    res = _hetero(two_widths, tmp_path / "full", monkeypatch)
    assert set(res.server_state) == {"class_logits", "widths"}            # no model tensor reached the server
    assert res.server_state["class_logits"].shape == (C, C)
    assert res.server_state["widths"] == {0: 64, 1: 32, 2: 64, 3: 32}
    for c, width in res.server_state["widths"].items():                  # each client keeps its own width
        assert res.personal_states[c]["head.weight"].shape == (C, width)
    m = res.metrics
    assert set(m[(m.split == "local") & (m.client >= 0)]["client"]) == {0, 1, 2, 3}
    # a resumed heterogeneous run equals the uninterrupted one
    assert _hetero(two_widths, tmp_path / "cut", monkeypatch, stop=1) is None
    resumed = _hetero(two_widths, tmp_path / "cut", monkeypatch)
    pd.testing.assert_frame_equal(res.metrics, resumed.metrics)


def test_several_backbones_need_client_backbones(two_widths, tmp_path, monkeypatch):
    monkeypatch.setattr(fedcore.train, "method_class", lambda name: LogitShare)
    with pytest.raises(ValueError, match="client_backbones"):
        train_run(run_params(), identity("logit_share"), two_widths["dataset"], two_widths["partition"],
                  ["vit_mini", "vit_mini_s"], [two_widths["weights"], two_widths["narrow"]],
                  tmp_path / "m.parquet", tmp_path / "f.pt", progress=False)


# ---- a CNN trained from scratch: BatchNorm buffers and a persistent optimiser ---------------------
class TinyCNN(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.body(x))


class CNNFedAvg(Method):
    """FedAvg of a small CNN with BatchNorm, trained from scratch (the frozen backbone is unused)."""

    name = "cnn_fedavg"
    client_role = BatchableClient

    def build(self, backbone):
        return TinyCNN(self.num_classes)


class KeepOptClient(BatchableClient):
    keep_optimizer = True

    def shared_keys(self, keys):
        return [k for k in keys if not k.startswith("head.")]

    def personal_keys(self, keys):
        return [k for k in keys if k.startswith("head.")]


class CNNPersonalHead(CNNFedAvg):
    """FedAvg of the body (BatchNorm statistics included), a personal head, and each client's optimiser kept."""

    name = "cnn_keep_opt"
    client_role = KeepOptClient
    evaluator_role = PersonalEvaluator


def _cnn(files, out, monkeypatch, cls, stop=None, **fed):
    monkeypatch.setattr(fedcore.train, "method_class", lambda name: cls)
    out.mkdir(exist_ok=True)
    kw = {"rounds": 3, "participation": 1.0, **fed}
    return train_run(run_params(**kw), identity(cls.name), files["dataset"], files["partition"], "vit_mini",
                     files["weights"], out / "m.parquet", out / "f.pt", checkpoint_path=out / "ckpt.pt",
                     progress=False, stop_after_round=stop)


def test_state_keys_hold_batchnorm_buffers_but_not_a_frozen_backbones():
    model = TinyCNN(C)
    keys = state_keys(model)
    assert {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"} <= set(keys)
    frozen = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1)).requires_grad_(False)
    wrapper = nn.ModuleDict({"backbone": frozen, "head": nn.Linear(3, 2)})
    assert state_keys(wrapper) == ["head.weight", "head.bias"]


@pytest.mark.parametrize("cls", [CNNFedAvg, CNNPersonalHead])
def test_resume_with_batchnorm_buffers_and_a_kept_optimizer(tiny_run_files, tmp_path, monkeypatch, cls):
    full = _cnn(tiny_run_files, tmp_path / "full", monkeypatch, cls, rounds=4)
    assert "body.1.running_mean" in full.global_state                   # BatchNorm statistics are averaged
    assert int(full.global_state["body.1.num_batches_tracked"]) > 0
    if cls is CNNPersonalHead:
        opt = full.client_states[0]["optimizer"]
        assert opt["state"] and all("momentum_buffer" in s for s in opt["state"].values())
    assert _cnn(tiny_run_files, tmp_path / "cut", monkeypatch, cls, rounds=4, stop=2) is None
    resumed = _cnn(tiny_run_files, tmp_path / "cut", monkeypatch, cls, rounds=4)
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
    for k, v in full.global_state.items():
        assert torch.equal(v, resumed.global_state[k]), k


def test_a_dropped_optimizer_state_changes_the_run(tiny_run_files, tmp_path, monkeypatch):
    """The kept optimiser matters (so the resume test above can fail): resetting it each round differs."""
    kept = _cnn(tiny_run_files, tmp_path / "a", monkeypatch, CNNPersonalHead)

    class Fresh(CNNPersonalHead):
        client_role = type("FreshClient", (KeepOptClient,), {"keep_optimizer": False})

    fresh = _cnn(tiny_run_files, tmp_path / "b", monkeypatch, Fresh)
    assert not kept.metrics["value"].equals(fresh.metrics["value"])


def test_cnn_with_batchnorm_trained_together_equals_one_by_one(tiny_run_files, tmp_path, monkeypatch):
    together = _cnn(tiny_run_files, tmp_path / "a", monkeypatch, CNNFedAvg, local_epochs=2)
    monkeypatch.setattr(loop, "_why_not_together", lambda method: "forced one by one")
    alone = _cnn(tiny_run_files, tmp_path / "b", monkeypatch, CNNFedAvg, local_epochs=2)
    a, b = together.metrics, alone.metrics
    pd.testing.assert_frame_equal(a.drop(columns="value"), b.drop(columns="value"))
    assert abs(a["value"].to_numpy() - b["value"].to_numpy()).max() < 1e-4
    for k, v in together.global_state.items():
        assert torch.allclose(v.double(), alone.global_state[k].double(), atol=1e-5), k


def test_a_method_that_cannot_train_together_says_so(tiny_run_files, tmp_path, monkeypatch, caplog):
    with caplog.at_level("INFO", logger="fedcore.engine.loop"):
        _cnn(tiny_run_files, tmp_path / "a", monkeypatch, CNNPersonalHead, rounds=1)
    assert "one by one: the client keeps its optimiser across rounds" in caplog.text


def test_strategy_default_is_fedavg_of_the_uplinks():
    from fedcore.engine.roles import FitResult, RoundInfo

    class Toy(Method):
        name = "toy"

        def build(self, backbone):
            return nn.Linear(2, 1)

    m = Toy(None, 2)
    s = m.strategy.init_state(2)
    ups = [FitResult(0, 1, {"model": {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}}, {}),
           FitResult(1, 3, {"model": {"weight": torch.full((1, 2), 5.0), "bias": torch.ones(1)}}, {})]
    new = m.strategy.aggregate(RoundInfo(1, 2, 1.0, 0), s, ups)
    assert torch.allclose(new["model"]["weight"], torch.full((1, 2), 4.0))
    assert torch.allclose(new["model"]["bias"], torch.tensor([0.75]))
    assert isinstance(m.strategy, Strategy) and m.strategy.select(RoundInfo(1, 2, 1.0, 0), new) == [0, 1]


# ---- the ResNet family: pixel-padding prompts around the image on a frozen ResNet ------------------
class PaddedResNetClassifier(nn.Module):
    def __init__(self, backbone, classes: int) -> None:
        super().__init__()
        self.backbone, self.pad = backbone, backbone.make_pad_prompt(width=3, init="normal")
        self.head = nn.Linear(backbone.feature_dim, classes)

    def forward(self, x):
        return self.head(self.backbone(x, self.pad))


class PadPromptFedAvg(Method):
    name = "pad_prompt"
    client_role = BatchableClient

    def build(self, backbone):
        return PaddedResNetClassifier(backbone, self.num_classes)


def test_a_frozen_resnet_trains_pixel_padding_prompts_and_head(tiny_run_files, tmp_path, monkeypatch):
    from fedcore.backbones.registry import build_backbone

    torch.manual_seed(2)
    torch.save(build_backbone("resnet_mini_18").state_dict(), tmp_path / "r18.pt")
    monkeypatch.setattr(fedcore.train, "method_class", lambda name: PadPromptFedAvg)
    built = []  # the run's frozen ResNet, to check afterwards that training left it as loaded
    monkeypatch.setattr(fedcore.train, "build_backbone", lambda *a, **k: built.append(build_backbone(*a, **k))
                        or built[-1])
    res = train_run(run_params(rounds=2, participation=1.0), identity("pad_prompt"), tiny_run_files["dataset"],
                    tiny_run_files["partition"], "resnet_mini_18", tmp_path / "r18.pt", tmp_path / "m.parquet",
                    tmp_path / "f.pt", progress=False)
    # only the prompts and the head are state: the frozen ResNet's BatchNorm statistics are not
    assert sorted(res.global_state) == ["head.bias", "head.weight", "pad.prompt_lr", "pad.prompt_tb"]
    assert res.global_state["pad.prompt_lr"].abs().sum() > 0
    m = res.metrics
    assert m[(m.metric == "acc") & (m.client == -1)]["value"].between(0, 1).all()
    loaded = torch.load(tmp_path / "r18.pt")
    after = built[0].state_dict()  # weights and BatchNorm statistics: unchanged by training and evaluation
    assert set(after) == set(loaded) and all(torch.equal(after[k].cpu(), v) for k, v in loaded.items())



def test_payload_numbers_counts_tensor_elements_and_scalars_through_nesting():
    from fedcore.engine.roles import payload_numbers

    payload = {"logits": torch.zeros(7, 11), "labels": torch.zeros(7, dtype=torch.long), "n": 3, "w": 0.5,
               "nested": {"a": [torch.ones(2, 3), 1.0], "b": None, "name": "x"}, "flag": True}
    assert payload_numbers(payload) == 77 + 7 + 1 + 1 + 6 + 1 + 1
    assert payload_numbers({}) == 0
    with pytest.raises(TypeError, match="a payload holds a object"):
        payload_numbers({"x": object()})
