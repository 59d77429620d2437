"""FedOTP's probes: Fig. A4's transport plans from saved prompts (each image with its own client's prompts) and
Fig. A5's t-SNE of the clients' local prompts; both figures show what is missing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from otp_helpers import build, clip, splits  # noqa: F401 (clip, splits: fixtures)
from fedcore.analysis.transport import pick_images, run_plans
from fedcore.analysis.probe_files import TRANSPORT_FORMAT, read_tsne
from fedcore.analysis.tsne import prompt_tsne
from fedcore.data.arrays import ArrayDataset, DatasetBundle, save_bundle
from fedcore.methods.fedotp import GLOBAL, LOCAL, transport_plans
from fedcore.partition.file import Partition
from fedcore.report.fig_probes import plan_heat, transport_plans_figure, tsne_figure
from fedcore.report.plotting import figure_notes

torch.set_num_threads(1)


def test_pick_images_takes_new_classes_in_each_clients_test_order():
    labels = np.array([0, 0, 1, 2, 1, 3])
    parts = [np.array([1, 0, 2]), np.array([4, 3, 5])]
    assert pick_images(parts, labels, [0, 1], 1) == [(0, 1), (1, 4)]
    assert pick_images(parts, labels, [0, 1], 2) == [(0, 1), (0, 2), (1, 3), (1, 5)]   # class 1 already shown
    with pytest.raises(ValueError, match="client 5"):
        pick_images(parts, labels, [5], 1)


def test_plans_use_each_images_own_client_prompts_and_the_figure_marks_missing_runs(clip, splits):
    _, test = splits
    method = build("fedotp", clip, n_ctx=4, ot_gamma=0.5)
    g = torch.Generator().manual_seed(3)
    shape = method.model.ctx_global.shape
    final = {"global": {GLOBAL: torch.randn(shape, generator=g)},
             "personal": {c: {LOCAL: torch.randn(shape, generator=g)} for c in range(2)}}
    tokens, labels = test.extras["clip_tokens"][:2].float(), test.y[:2]
    plans = run_plans(method, final, tokens, labels, [1, 0])                    # image 0 of client 1, image 1 of 0
    for i, cid in enumerate([1, 0]):
        with torch.no_grad():
            method.model.ctx_global.copy_(final["global"][GLOBAL])
            method.model.ctx_local.copy_(final["personal"][cid][LOCAL])
        expect = transport_plans(method, method.model, tokens[i : i + 1], labels[i : i + 1])[0]
        np.testing.assert_allclose(plans[i], expect.numpy(), rtol=1e-6)
    assert plans.shape == (2, 16, 2) and np.allclose(plans.sum((1, 2)), 0.5, atol=1e-5)   # mass gamma
    with pytest.raises(ValueError, match="ctx_local"):
        run_plans(method, {"global": final["global"], "personal": {}}, tokens, labels, [0, 0])

    data = {"images": np.zeros((2, 16, 16, 3), np.uint8), "labels": np.array([0, 1]), "clients": np.array([1, 0]),
            "plans": np.stack([plans, np.full_like(plans, np.nan)]),
            "meta": {"format": TRANSPORT_FORMAT, "grid": [4, 4], "runs": ["gamma=0.5", "gamma=1"],
                     "status": ["ok", "missing run"], "class_names": ["zero", "one"], "arch": "tiny"}}
    fig = transport_plans_figure(data, {"caption": "Fig. A4"})
    assert len(fig.axes) == 2 * 5 and "gamma=1 (missing run)" in figure_notes(fig)
    heat = plan_heat(plans[0, :, 0], (4, 4))
    assert heat.min() == 0.0 and heat.max() == 1.0 and not plan_heat(np.ones(16), (4, 4)).any()


def test_prompt_tsne_colours_each_client_by_its_coarse_class(tmp_path: Path, monkeypatch):
    import fedcore.analysis.tsne as tsne

    seen = {}
    # t-SNE itself is tested with SGPT's probe; here: which vectors and labels reach it (and sklearn's import is slow)
    monkeypatch.setattr(tsne, "tsne_embedding", lambda f, p, s: seen.setdefault("f", f)[:, :2].astype(np.float32))
    rng = np.random.default_rng(0)
    y = np.arange(24) % 4
    split = ArrayDataset(x=np.zeros((24, 4, 4, 3), np.uint8), y=y, coarse=y // 2)
    save_bundle(DatasetBundle(train=split, test=split, meta={"classes": list("abcd"), "coarse_classes": ["lo", "hi"]}),
                tmp_path / "data.npz")
    owned = [np.flatnonzero(y == c) for c in (0, 1, 2, 3, 0, 2)]       # clients 0, 1, 4 coarse 0; 2, 3, 5 coarse 1
    Partition(train=owned, test=owned, spec={"scheme": "coarse_split"}, seed=0).save(tmp_path / "part.npz")
    centre = {0: np.zeros(8), 1: np.full(8, 5.0)}
    personal = {c: {LOCAL: torch.tensor(centre[int(y[idx[0]] // 2)] + rng.normal(0, 0.1, 8)).view(2, 4)}
                for c, idx in enumerate(owned)}
    torch.save({"personal": personal}, tmp_path / "final.pt")
    prompt_tsne(tmp_path / "final.pt", tmp_path / "data.npz", tmp_path / "part.npz", {"perplexity": 30},
                tmp_path / "out.npz")
    data = read_tsne(tmp_path / "out.npz")
    assert data["labels"].tolist() == [0, 0, 1, 1, 0, 1] and data["embeddings"][0].shape == (6, 2)
    np.testing.assert_allclose(seen["f"][3], personal[3][LOCAL].flatten().numpy(), rtol=1e-6)   # flattened 2 x 4
    assert data["meta"]["perplexity"] == pytest.approx(5 / 3)           # capped below the 6 clients
    fig = tsne_figure(data, {"caption": "Fig. A5"})
    assert fig.axes[0].get_title() == LOCAL
    torch.save({"personal": {0: personal[0]}}, tmp_path / "short.pt")
    with pytest.raises(ValueError, match=r"clients \[1, 2"):
        prompt_tsne(tmp_path / "short.pt", tmp_path / "data.npz", tmp_path / "part.npz", {}, tmp_path / "bad.npz")
