"""FedPFT's probes and analyses (Tables 1, 4, 5, 8; Figs. 2, 3, 4, 6) pinned step by step against the paper.

Paper lines refer to /work/shared/papers/fedpft_arxiv2407.16139.txt. Each value here is computed by hand in plain
torch / numpy from what the paper states (and, where it states nothing, from the spec's documented reading, spec
fedpft §1.12, DEVIATIONS.md "FedPFT probes"), not by calling the helper under test:

* l.34 (Table 1 Probe, Tables 4/8 l.236, l.424): "each client employs a randomly initialized linear classifier
  (probe) behind the feature extractor, and this classifier is subsequently retrained" -> a fresh Linear(m, C)
  (PyTorch's default init) trained by CE on the client's own frozen train features; [R] SGD lr 0.01, momentum 0.9,
  no weight decay, batch 100 (a short last batch averages over its own length), 100 epochs; scored on its test split.
* l.36 (Table 1 Match): "a linear layer between the global feature extractor and the classifier on each client,
  training this layer with local data" -> W in R^{m x m} (+ b), [R] W = I, b = 0, classifier frozen.
* Table 1 Origin: the model's own prediction h_κ(τ([φ(x), p_κ,i])_0) on the client's test split.
* Tables 4/8 (FedPFT = Table 5's p_κ row, 87.83 = 87.83): f' = τ([φ(x), p_κ,i])_0 with the global φ, τ and the
  client's own p_κ,i; l.280 Table 5: None = τ([φ(x)])_0 ([R]), p_κ, p_ρ; frozen extractor in eval mode.
* Per-client values averaged over clients (unweighted), then over seeds (§4.1 "average accuracy ... all clients").
* l.248 Fig. 2: t-SNE of the test features of all clients, colour = class, marker = client; l.267 Fig. 3: features
  transformed by p_κ / p_ρ, "larger markers ... feature centroids of corresponding classes for each client" ([R]
  the mean of the client's t-SNE points of that class); [R] sklearn TSNE(perplexity 30, PCA init, seed 0).
* l.444 Fig. 6: "20 test samples from a single client", rows = samples, columns = [f, prompts of p_κ,i or p_ρ,i],
  values = attention weights of the output feature f' ([R] averaged over heads; the client's first 20 test images).
* l.358 Fig. 4 / l.248 Fig. 2(a): per (client, class) train-sample counts, dot size ~ volume; 20 clients / 10 clients
  x 1000 train / 500 test.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from torch import nn

from conftest import identity, run_params
import fedcore.analysis.linear_probe as lp

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# hand-written references (from the paper's text, plain torch)
# ---------------------------------------------------------------------------------------------------------------

def hand_sgd(W: torch.Tensor, b: torch.Tensor, logits_fn, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float,
             momentum: float, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGD with heavy-ball momentum (v <- μ v + g; p <- p - lr v) on the batch-mean CE of logits_fn(W, b, x_batch);
    the gradient of CE w.r.t. the logits is (softmax - onehot) / batch, chained by hand in ``logits_fn``."""
    gen = torch.Generator().manual_seed(seed)
    vW, vb = torch.zeros_like(W), torch.zeros_like(b)
    n = len(y)
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for s in range(0, n, batch):
            i = order[s:s + batch]
            z, back = logits_fn(W, b, x[i])
            g = (torch.softmax(z, dim=1) - torch.eye(z.shape[1])[y[i]]) / len(i)   # dCE/dz, mean over the batch
            gW, gb = back(g)
            vW, vb = momentum * vW + gW, momentum * vb + gb
            W, b = W - lr * vW, b - lr * vb
    return W, b


def probe_logits(W, b, xb):
    """A linear probe z = x Wᵀ + b and its backward (dz -> dW, db)."""
    return xb @ W.T + b, lambda g: (g.T @ xb, g.sum(0))


def match_logits(head_w, head_b):
    """z = h(W f + b) with h frozen: backward reaches W, b only (through h's weight)."""
    def fn(W, b, xb):
        u = xb @ W.T + b
        return u @ head_w.T + head_b, lambda g: ((g @ head_w).T @ xb, (g @ head_w).sum(0))
    return fn


def default_linear_init(m: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's default Linear init drawn by hand: W, b ~ U(-1/√m, 1/√m), weight first, from the seeded global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        bound = 1.0 / math.sqrt(m)
        W = torch.empty(c, m).uniform_(-bound, bound)
        b = torch.empty(c).uniform_(-bound, bound)
    return W, b


def hand_tau(f: torch.Tensor, prompts: torch.Tensor | None, sd: dict, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """τ([f, p])_0 by hand (App. F: self-attention over [f, p_1..p_n], output token 0) and token 0's attention over
    the 1 + n inputs averaged over heads: q = W_q f, K = W_k X, V = W_v X, per head softmax(q·k / √d_h)."""
    m = f.shape[1]
    X = f[:, None] if prompts is None else torch.cat([f[:, None], prompts[None].expand(len(f), -1, -1)], 1)
    Wi, bi = sd["tau.attn.in_proj_weight"], sd["tau.attn.in_proj_bias"]
    q = f @ Wi[:m].T + bi[:m]
    K = X @ Wi[m:2 * m].T + bi[m:2 * m]
    V = X @ Wi[2 * m:].T + bi[2 * m:]
    dh = m // heads
    qh, Kh, Vh = q.view(len(f), heads, dh), K.view(len(f), -1, heads, dh), V.view(len(f), -1, heads, dh)
    a = torch.softmax(torch.einsum("bhd,bthd->bht", qh, Kh) / math.sqrt(dh), dim=-1)
    o = torch.einsum("bht,bthd->bhd", a, Vh).reshape(len(f), m)
    return o @ sd["tau.attn.out_proj.weight"].T + sd["tau.attn.out_proj.bias"], a.mean(1)


def _capture_fit(monkeypatch) -> list[list[torch.Tensor]]:
    """Record the parameters ``fit_sgd`` leaves (the probe's / match layer's trained weights)."""
    got, real = [], lp.fit_sgd

    def spy(params, *a, **k):
        real(params, *a, **k)
        got.append([p.detach().clone() for p in params])
    monkeypatch.setattr(lp, "fit_sgd", spy)
    return got


def _blobs(n: int, m: int = 6, c: int = 3, seed: int = 0, noise: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, c, (n,), generator=g)
    return torch.eye(m)[:c][y] * 2.0 + noise * torch.randn(n, m, generator=g), y


# ---------------------------------------------------------------------------------------------------------------
# Table 1 Probe, Tables 4, 5, 8: the linear probe itself
# ---------------------------------------------------------------------------------------------------------------

def test_probe_settings_are_the_documented_ones():
    """The paper states no optimiser for the probe (l.34): ours is spec §1.12a [R] as DEVIATIONS writes it."""
    s = lp.ProbeSettings()
    assert (s.epochs, s.lr, s.momentum, s.batch_size) == (100, 0.01, 0.9, 100)
    assert lp.ProbeSettings.from_dict(None) == s  # probe_linear.py passes no settings: these are the pipeline's


def test_probe_is_a_fresh_default_init_linear_trained_by_sgd_momentum_on_batch_mean_ce(monkeypatch):
    """l.34: a randomly initialised Linear(m, C) retrained on the client's features: by hand, default init, 100
    epochs of SGD(0.01, momentum 0.9) on the batch-mean CE, batches of 100 shuffled per epoch (250 samples: the
    last batch of 50 averages over its own 50), then test accuracy = mean(argmax == y)."""
    got = _capture_fit(monkeypatch)
    (a, ay), (t, ty) = _blobs(250, seed=0), _blobs(80, seed=1)
    s = lp.ProbeSettings()
    acc = lp.linear_probe(a, ay, t, ty, 3, s, seed=11)
    W0, b0 = default_linear_init(6, 3, 11)
    W, b = hand_sgd(W0, b0, probe_logits, a, ay, s.epochs, s.lr, s.momentum, s.batch_size, 11)
    torch.testing.assert_close(got[0][0], W, **TOL)
    torch.testing.assert_close(got[0][1], b, **TOL)
    ref = float(((t @ W.T + b).argmax(1) == ty).float().mean())
    assert acc == pytest.approx(ref) and 0.4 < acc < 1.0  # not a trivial value: the pin sees the weights' effect


def test_match_layer_is_identity_initialised_and_only_it_learns_through_the_frozen_classifier(monkeypatch):
    """l.36: Match Acc. = a linear layer between the extractor and the classifier, trained on local data; [R] W = I,
    b = 0; the classifier frozen (no gradient, unchanged); by hand with the same SGD and batch order."""
    got = _capture_fit(monkeypatch)
    (a, ay), (t, ty) = _blobs(250, seed=2), _blobs(80, seed=3)
    head = nn.Linear(6, 3)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3, 6, generator=torch.Generator().manual_seed(5)))
    hw, hb = head.weight.detach().clone(), head.bias.detach().clone()
    s = lp.ProbeSettings(epochs=20)
    acc = lp.match_accuracy(a, ay, t, ty, head, s, seed=4)
    W, b = hand_sgd(torch.eye(6), torch.zeros(6), match_logits(hw, hb), a, ay, s.epochs, s.lr, s.momentum,
                    s.batch_size, 4)
    torch.testing.assert_close(got[0][0], W, **TOL)
    torch.testing.assert_close(got[0][1], b, **TOL)
    assert torch.equal(head.weight, hw) and torch.equal(head.bias, hb) and head.weight.grad is None
    ref = float((((t @ W.T + b) @ hw.T + hb).argmax(1) == ty).float().mean())
    assert acc == pytest.approx(ref)
    # at W = I the layer changes nothing: with no epochs Match is the classifier's own accuracy on the features
    zero = lp.match_accuracy(a, ay, t, ty, head, lp.ProbeSettings(epochs=0), seed=4)
    assert zero == pytest.approx(float(((t @ hw.T + hb).argmax(1) == ty).float().mean()))


# ---------------------------------------------------------------------------------------------------------------
# which model, which features, which split (a FedPFT run rebuilt from its final.pt)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pft(tiny_run_files, tmp_path_factory):
    """A FedPFT 'final.pt' whose global state and prompts are perturbed so that each choice shows in the numbers:
    τ with peaked attention, BatchNorm running statistics far from (0, 1) (train mode would differ), a classifier
    that does not predict one class, prompts of unit scale, different per client."""
    from fedcore.analysis.trained_run import load_trained_run
    from fedcore.backbones.registry import build_backbone, prompt_adapter
    from fedcore.data.arrays import load_bundle
    from fedcore.methods.fedpft import FedPFT
    from fedcore.partition.file import Partition

    mp = {"queue_size": 8, "n_kappa": 3, "n_rho": 2, "feature_epochs": 1}
    params = {**run_params(rounds=1, participation=1.0), "method": "fedpft", "method_params": mp}
    torch.manual_seed(0)
    method = FedPFT(prompt_adapter(build_backbone("resnet8_pft_mini")), load_bundle(tiny_run_files["dataset"]).num_classes, mp)
    server = method.strategy.init_state(4)
    g = torch.Generator().manual_seed(1)
    sd = server["model"]
    for k in list(sd):
        if k.endswith("running_mean"):
            sd[k] = sd[k] + 0.5 * torch.randn(sd[k].shape, generator=g)
        elif k.endswith("running_var"):
            sd[k] = sd[k] * 3.0
    sd["tau.attn.in_proj_weight"] = sd["tau.attn.in_proj_weight"] * 6.0
    sd["head.weight"] = torch.randn(sd["head.weight"].shape, generator=g)
    clients = {c: method.client.init_state(c) for c in range(4)}
    for c in clients:
        for name in ("p_kappa", "p_rho"):
            clients[c]["model"][name] = clients[c]["model"][name] * 50.0
    path = tmp_path_factory.mktemp("pft_probe_eq") / "final.pt"
    torch.save({"identity": identity("fedpft"), "server": server, "clients": clients}, path)
    run = load_trained_run(params, identity("fedpft"), tiny_run_files["dataset"], tiny_run_files["partition"],
                           "resnet8_pft_mini", None, path, device="cpu")
    saved = torch.load(path, weights_only=False)
    bundle = load_bundle(tiny_run_files["dataset"])
    part = Partition.load(tiny_run_files["partition"])
    # φ by hand: the architecture only, every weight and buffer from the saved global state, eval mode
    net = copy.deepcopy(run.client_model(0).net)
    net.load_state_dict({k[4:]: v for k, v in saved["server"]["model"].items() if k.startswith("net.")})
    net.eval()
    return {"run": run, "saved": saved, "bundle": bundle, "part": part, "net": net,
            "heads": run.client_model(0).tau.attn.num_heads}


def _inputs(pipe, x_uint8: np.ndarray) -> torch.Tensor:
    """The model input by hand: HWC uint8 -> CHW, /255 scaled affine normalisation (no augmentation)."""
    x = torch.as_tensor(x_uint8).permute(0, 3, 1, 2).float()
    mean, std = torch.tensor(pipe.mean).view(1, 3, 1, 1), torch.tensor(pipe.std).view(1, 3, 1, 1)
    assert x.shape[-1] == pipe.img_size  # the tiny images need no resize
    return (x / 255.0 - mean) / std


@torch.no_grad()
def hand_features(pft, cid: int, split: str, kind: str, first: int | None = None):
    """(features, labels) of client ``cid``'s ``split`` in partition order: φ(x) with the global weights in eval
    mode, then τ by hand with the global τ and the client's own prompts (kind phi | none | p_kappa | p_rho)."""
    bundle, part = pft["bundle"], pft["part"]
    data, idx = (bundle.train, part.train[cid]) if split == "train" else (bundle.test, part.test[cid])
    idx = idx[:first] if first is not None else idx
    phi = pft["net"](_inputs(pft["run"].pipeline, data.x[idx])).float()
    y = torch.as_tensor(data.y[idx]).long()
    if kind == "phi":
        return phi, y
    own = pft["saved"]["clients"][cid]["model"]
    prompts = None if kind == "none" else own[kind]
    return hand_tau(phi, prompts, pft["saved"]["server"]["model"], pft["heads"])[0], y


def test_each_client_is_probed_on_its_own_train_features_and_scored_on_its_test_features(pft, monkeypatch):
    """Tables 4/5/8: per client, the probe's train features are its own train split's and its test features its own
    test split's; default = p_κ = τ([φ(x), p_κ,i])_0 (global φ, τ; own p_κ,i), phi = φ(x), none = τ([φ(x)])_0,
    p_ρ = τ([φ(x), p_ρ,i])_0; φ in eval mode (BatchNorm running statistics). Origin = h_κ(f') accuracy on the test
    split; Match reads the same features and the global h_κ."""
    probes, matches = [], []
    real_probe, real_match = lp.linear_probe, lp.match_accuracy
    monkeypatch.setattr(lp, "linear_probe", lambda *a, **k: probes.append(a) or real_probe(*a, **k))
    monkeypatch.setattr(lp, "match_accuracy", lambda *a, **k: matches.append(a) or real_match(*a, **k))
    df = lp.probe_run(pft["run"], identity("fedpft"), lp.ProbeSettings(epochs=1), logged=None)
    head = pft["saved"]["server"]["model"]
    order = [f for f in df.loc[(df.client == 0) & (df.measure == "probe"), "feature"] if f != "p_kappa"]
    assert order == ["default", "phi", "none", "p_rho"]
    calls = iter(probes)
    for c in range(4):
        ref = {k: (hand_features(pft, c, "train", k), hand_features(pft, c, "test", k))
               for k in ("p_kappa", "phi", "none", "p_rho")}
        for kind in ("p_kappa", "phi", "none", "p_rho"):
            a, ay, t, ty, n_classes = next(calls)[:5]
            (ra, ray), (rt, rty) = ref[kind]
            torch.testing.assert_close(a, ra, **TOL)
            torch.testing.assert_close(t, rt, **TOL)
            assert torch.equal(ay, ray) and torch.equal(ty, rty) and n_classes == 4
        (fa, fay), (ft, fty) = ref["p_kappa"]
        origin = float(((ft @ head["head.weight"].T + head["head.bias"]).argmax(1) == fty).float().mean())
        got = df.loc[(df.client == c) & (df.measure == "origin"), "value"].item()
        assert got == pytest.approx(origin)
        ma, may, mt, mty, mhead = matches[c][:5]
        torch.testing.assert_close(ma, fa, **TOL)
        torch.testing.assert_close(mt, ft, **TOL)
        assert torch.equal(mhead.weight, head["head.weight"]) and torch.equal(mhead.bias, head["head.bias"])
        row = df.loc[(df.client == c) & (df.measure == "probe")]
        assert (row["n_train"] == len(pft["part"].train[c])).all() and (row["n_test"] == len(pft["part"].test[c])).all()
    # Table 4's FedPFT cell is Table 5's p_κ cell: the same number
    p = df[df.measure == "probe"].pivot(index="client", columns="feature", values="value")
    assert (p["p_kappa"] == p["default"]).all()
    # the perturbed τ and prompts make the kinds differ (otherwise the checks above could not tell them apart)
    (k0, _), (r0, _) = hand_features(pft, 0, "test", "p_kappa"), hand_features(pft, 0, "test", "p_rho")
    (n0, _), (k1, _) = hand_features(pft, 0, "test", "none"), hand_features(pft, 1, "test", "p_kappa")
    assert min((k0 - r0).abs().max(), (k0 - n0).abs().max(), (k0 - k1[:1]).abs().max()) > 1e-2


def test_the_table_cell_is_the_unweighted_client_mean_per_seed_then_the_seed_mean_and_sample_std():
    """§4.1's "average accuracy achieved by all clients": each client counts once whatever its test size (at paper
    every client holds 100 test images, so weighting would not matter there); then mean, std (ddof 1) over seeds."""
    from fedcore.report.probe_table import build_probe_table

    vals = {0: [(1.0, 10), (0.0, 30)], 1: [(0.5, 10), (0.9, 30)]}   # seed -> [(accuracy, n_test) per client]
    rows = pd.DataFrame([{"experiment": "e", "method": "fedpft", "scale": "mini", "seed": s, "client": c,
                          "feature": "default", "measure": "probe", "value": v, "n_test": n}
                         for s, cl in vals.items() for c, (v, n) in enumerate(cl)])
    cfg = {"rows": ["fedpft"], "columns": [{"label": "x", "experiment": "e"}], "paper": {}}
    t = build_probe_table(rows, cfg, {"e": {"methods": ["fedpft"]}}, "mini", {"fedpft"}).iloc[0]
    per_seed = [np.mean([v for v, _ in cl]) * 100 for cl in vals.values()]   # 50 and 70 (weighted: 25 and 80)
    assert t["ours"] == pytest.approx(np.mean(per_seed))
    assert t["ours_std"] == pytest.approx(np.std(per_seed, ddof=1))


# ---------------------------------------------------------------------------------------------------------------
# Fig. 6: τ's attention weights
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, cid", [("p_kappa", 0), ("p_rho", 2)])
def test_fig6_rows_are_the_clients_first_test_samples_and_columns_f_then_its_prompts(pft, prompts, cid):
    """App. F: rows = test samples of one client, columns = [f, p_1..p_n] of p_κ,i or p_ρ,i, values = the attention
    weights of the output feature f' (token 0), by hand and averaged over heads; the first samples in order."""
    from fedcore.analysis.run_features import attention_weights

    w, labels = attention_weights(pft["run"], cid, prompts, 5)
    phi, y = hand_features(pft, cid, "test", "phi", first=5)
    own = pft["saved"]["clients"][cid]["model"][prompts]
    ref = hand_tau(phi, own, pft["saved"]["server"]["model"], pft["heads"])[1]
    np.testing.assert_allclose(w, ref.numpy(), rtol=1e-4, atol=1e-5)
    assert w.shape == (5, 1 + len(own)) and np.array_equal(labels, y.numpy())
    assert np.ptp(w) > 0.05  # peaked attention: the head average and the column order are visible in the numbers


# ---------------------------------------------------------------------------------------------------------------
# Figs. 2, 3: t-SNE of every client's test features with its own model
# ---------------------------------------------------------------------------------------------------------------

def test_fig2_fig3_points_are_every_clients_test_features_with_labels_and_client_ids(pft):
    """§4.5: the feature vectors of testing data from different clients (colour = class, marker = client); Fig. 2
    reads φ(x) ([R]), Fig. 3 τ's output with p_κ and with p_ρ, each client's own prompts."""
    from fedcore.analysis.run_features import run_features

    for kind in ("phi", "p_kappa", "p_rho"):
        feats, labels, clients = run_features(pft["run"], kind)
        ref = [hand_features(pft, c, "test", kind) for c in range(4)]
        np.testing.assert_allclose(feats, torch.cat([f for f, _ in ref]).numpy(), rtol=1e-4, atol=1e-5)
        assert np.array_equal(labels, torch.cat([y for _, y in ref]).numpy())
        assert np.array_equal(clients, np.concatenate([np.full(len(y), c) for c, (_, y) in enumerate(ref)]))


def test_tsne_is_sklearns_with_pca_init_and_the_figures_seed_and_perplexity():
    """[R] spec §1.12d: sklearn TSNE(2 components, perplexity, init 'pca', random_state = the figure's seed)."""
    from sklearn.manifold import TSNE

    from fedcore.analysis.tsne import tsne_embedding

    x = np.random.default_rng(0).normal(size=(40, 5)).astype(np.float32)
    ref = TSNE(n_components=2, perplexity=5.0, init="pca", random_state=3, learning_rate="auto").fit_transform(x)
    np.testing.assert_allclose(tsne_embedding(x, 5.0, 3), ref, rtol=1e-4, atol=1e-4)
    figs = yaml.safe_load((ROOT / "config/reports/fedpft.yaml").read_text())["figures"]
    for name in ("fedpft_fig2", "fedpft_fig3"):  # probe_run_tsne.py's defaults: perplexity 30, seed 0
        assert figs[name].get("perplexity", 30) == 30 and figs[name].get("seed", 0) == 0


def test_fig3_large_markers_are_each_clients_class_centroids_of_its_points():
    """§4.6: "Larger markers ... represent feature centroids of corresponding classes for each client": ([R]) the
    mean of the client's t-SNE points of that class, one per (client, class) present."""
    from fedcore.analysis.probe_files import RUN_TSNE_FORMAT
    from fedcore.report.fig_pft_probes import tsne_runs_figure

    rng = np.random.default_rng(0)
    emb, labels, clients = rng.normal(size=(30, 2)), rng.integers(0, 3, 30), np.repeat([0, 1, 2], 10)
    meta = {"format": RUN_TSNE_FORMAT, "perplexity": 30, "seed": 0,
            "panels": [{"label": "a", "method": "fedpft", "feature": "p_kappa", "status": "ok", "clients": 3}]}
    fig = tsne_runs_figure(meta, {"emb_0": emb, "labels_0": labels, "clients_0": clients}, {"centroids": True})
    big = [c.get_offsets()[0] for c in fig.axes[0].collections if len(c.get_sizes()) == 1 and c.get_sizes()[0] == 70]
    ref = [emb[(clients == c) & (labels == k)].mean(0) for c in range(3) for k in np.unique(labels[clients == c])]
    np.testing.assert_allclose(np.array(big), np.array(ref), rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# Fig. 4 and Fig. 2(a): the partitions
# ---------------------------------------------------------------------------------------------------------------

def test_fig4_dots_are_each_clients_train_count_per_class_with_area_proportional_to_it(pft_files):
    """App. B.1: "Each red dot indicates the class data assigned to a client, with larger dots signifying a higher
    volume": one dot per (client, class) with train samples, area ∝ count (by hand: a bincount per client)."""
    from fedcore.data.arrays import load_bundle
    from fedcore.partition.file import Partition
    from fedcore.report.data_outputs import bubble_counts, partition_bubbles_figure

    y = load_bundle(pft_files["dataset"]).train.y
    part = Partition.load(pft_files["partition"])
    ref = [(c, k, n) for c, idx in enumerate(part.train)
           for k, n in enumerate(np.bincount(y[idx], minlength=4)) if n > 0]
    got = bubble_counts(y, None, part.train)
    assert list(zip(got["client"], got["class"], got["count"])) == ref
    fig = partition_bubbles_figure({"panels": [{"label": "a"}]}, pft_files["dataset"], [pft_files["partition"]])
    dots = fig.axes[0].collections[0]
    biggest = max(n for *_, n in ref)
    np.testing.assert_allclose(dots.get_sizes(), [300.0 * n / biggest for *_, n in ref])
    # ours draws x = client, y = class (the paper the other way round; DEVIATIONS "FedPFT probes")
    np.testing.assert_allclose(dots.get_offsets(), [(c, k) for c, k, _ in ref])


def test_the_configured_probe_experiments_are_the_papers():
    """Setups the paper states: Fig. 2/3 CIFAR-10, 10 clients x 1000 train / 500 test (l.248); Fig. 4 20 clients, a
    10-class dataset and (DEVIATIONS) CIFAR-100 for its 50-class one, several α (l.358); Fig. 6 one client's 20 test
    samples, CIFAR-10 FedPFT, p_κ and p_ρ (l.444); Table 1 CIFAR-10 α 0.5 / 1.0 Probe / Origin / Match (l.27);
    Tables 4/8 CIFAR-10 and CIFAR-100 at α 0.1 / 0.5 / 1.0; Table 5 None / p_κ / p_ρ (l.280)."""
    exps = yaml.safe_load((ROOT / "config/experiments/fedpft.yaml").read_text())["experiments"]
    rep = yaml.safe_load((ROOT / "config/reports/fedpft.yaml").read_text())
    viz = exps["pft_c10_viz"]
    assert viz["dataset"] == "cifar10" and viz["partition"]["clients"] == 10
    assert (viz["partition"]["train_per_client"], viz["partition"]["test_per_client"]) == (1000, 500)
    fig2 = rep["figures"]["fedpft_fig2"]["panels"]
    assert {p["method"] for p in fig2} == {"fedavg", "fedper", "fedcac", "pft_wo_con", "fedpft", "pft_s8",
                                           "pft_p_classifier"} <= set(viz["methods"])
    fig3 = rep["figures"]["fedpft_fig3"]
    assert [(p["experiment"], p["method"], p["feature"]) for p in fig3["panels"]] == [
        ("pft_c10_viz", "fedpft", "p_kappa"), ("pft_c10_viz", "fedpft", "p_rho")] and fig3["centroids"] is True
    assert {p["experiment"] for p in fig2} == {"pft_c10_viz"} and {p["feature"] for p in fig2} == {"phi"}
    for ds, n_classes in (("c10", "cifar10"), ("c100", "cifar100")):
        for a in ("0p1", "0p5", "1p0"):
            e = exps[f"pft_fig4_{ds}_dir{a}"]
            assert e["dataset"] == n_classes and e["partition"]["clients"] == 20 and e["methods"] == []
    f6 = rep["figures"]["fedpft_fig6"]
    assert (f6["client"], f6["samples"]) == (0, 20)
    assert {(p["experiment"], p["method"], p["prompts"]) for p in f6["panels"]} == {
        (f"pft_c10_dir{a}", "fedpft", pr) for a in ("0p1", "0p5", "1p0") for pr in ("p_kappa", "p_rho")}
    t1 = rep["tables"]["fedpft_table1"]
    assert [(c["experiment"], c["measure"]) for c in t1["columns"]] == [
        (f"pft_c10_dir{a}", m) for a in ("0p5", "1p0") for m in ("probe", "origin", "match")]
    assert t1["rows"] == ["fedavg", "fedper", "fedbn", "fedcac", "fedpft"]
    cols = [c["experiment"] for c in rep["tables"]["fedpft_table8"]["columns"]]
    assert cols == [f"pft_{d}_dir{a}" for d in ("c10", "c100") for a in ("0p1", "0p5", "1p0")]
    src = rep["tables"]["fedpft_table5"]["row_sources"]
    assert [(src[r]["method"], src[r]["feature"]) for r in ("ptype_none", "ptype_p_kappa", "ptype_p_rho")] == [
        ("fedpft", "none"), ("fedpft", "p_kappa"), ("fedpft", "p_rho")]
