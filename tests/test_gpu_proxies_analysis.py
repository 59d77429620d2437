"""GPU proxies for the jobs outside training that run on CUDA when ``device: auto`` finds a GPU: the feature caches
(Select queries, CLIP tokens), the probes (t-SNE, FedPFT's linear probe, match layer, feature maps and attention,
FedOTP's transport plans) and backbone pretraining, each run on the strict virtual device (tests/virtual_device.py:
torch's same-device error for a CPU tensor beside a device one, and CUDA's refusals of ``.numpy()`` and of a CPU
generator drawing on the device)."""
from __future__ import annotations

import pytest
import torch

from conftest import identity, run_params, synthetic_bundle
from fedcore.data.arrays import DatasetBundle, save_bundle
from fedcore.partition.make import make_partition
from virtual_device import VIRTUAL, OnVirtualDevice

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small bundle, a 4-client IID partition and random vit_mini weights."""
    from fedcore.backbones.vit import build_vit

    root = tmp_path_factory.mktemp("analysis_proxy")
    b = synthetic_bundle(n_train=40, n_test=24)
    save_bundle(b, root / "d.npz")
    make_partition({"scheme": "iid", "clients": 4}, 0, b.train.y, b.test.y).save(root / "p.npz")
    torch.manual_seed(0)
    torch.save(build_vit("vit_mini").state_dict(), root / "w.pt")
    return {"root": root, "bundle": b, "dataset": root / "d.npz", "partition": root / "p.npz", "weights": root / "w.pt"}


@pytest.fixture
def on_device(monkeypatch):
    """Every job's ``pick_device`` answers the virtual device."""
    import fedcore.analysis.trained_run as trained_run
    import fedcore.analysis.tsne as tsne
    import fedcore.artifacts.clip_tokens as clip_tokens
    import fedcore.artifacts.select_queries as select_queries

    for mod in (tsne, select_queries, clip_tokens, trained_run):
        monkeypatch.setattr(mod, "pick_device", lambda requested="auto": VIRTUAL)


def test_the_strict_virtual_device_refuses_what_cuda_refuses():
    with OnVirtualDevice(strict=True):
        x = torch.ones(3).to(VIRTUAL)
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        with pytest.raises(RuntimeError, match="device type for generator"):
            torch.randn(3, device=VIRTUAL, generator=torch.Generator().manual_seed(0))
        with pytest.raises(RuntimeError, match="device type for generator"):
            torch.empty(3, device=VIRTUAL).uniform_(generator=torch.Generator().manual_seed(0))
        torch.randn(3, device=VIRTUAL, generator=torch.Generator(device=VIRTUAL).manual_seed(0))
        assert x.cpu().numpy().tolist() == [1.0, 1.0, 1.0]
        with torch.autocast(VIRTUAL.type, enabled=False):  # torch refuses "meta"; the proxy runs it as the CPU's
            pass


def test_feature_caches_and_tsne_run_on_the_device(files, on_device):
    from fedcore.analysis.tsne import compute_tsne
    from fedcore.artifacts.clip_tokens import compute_clip_tokens
    from fedcore.artifacts.select_queries import compute_select_queries

    root = files["root"]
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32  # the feature jobs switch TF32 off
    try:
        with OnVirtualDevice(strict=True):
            compute_select_queries(files["dataset"], "vit_mini", files["weights"], 1, root / "q.npz")
            compute_clip_tokens(files["dataset"], "clip_mini", None, root / "c.npz")
            compute_tsne(files["dataset"], "vit_mini", files["weights"], {"per_class": 3, "blocks": [1, 2],
                                                                         "perplexity": 2}, root / "t.npz")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("objective, arch", [("supervised", "vit_mini"), ("moco", "vit_mini"), ("clip", "clip_mini")])
def test_pretraining_runs_on_the_device(files, objective, arch):
    from fedcore.backbones.pretrain import pretrain

    b = files["bundle"]
    bundle = DatasetBundle(train=b.train, test=b.test, pretrain=b.train,
                           meta={**b.meta, "pretrain_clip_names": ["a", "b", "c", "d"]})
    with OnVirtualDevice(strict=True):
        stats = pretrain(bundle, arch, None, objective, epochs=1, batch_size=16, device=VIRTUAL, progress=False)
    assert stats["device"] == str(VIRTUAL)


def test_fedpft_probes_run_on_the_device(files, on_device):
    """The rebuilt run on the device (cached features off), its probe rows, feature maps and τ's attention."""
    from fedcore.analysis.linear_probe import ProbeSettings, probe_run
    from fedcore.analysis.run_features import attention_weights, run_features
    from fedcore.analysis.trained_run import load_trained_run
    from fedcore.backbones.registry import build_backbone, prompt_adapter
    from fedcore.methods.fedpft import FedPFT

    mp = {"queue_size": 8, "n_kappa": 3, "n_rho": 2, "feature_epochs": 1}
    params = {**run_params(rounds=1, participation=1.0), "method": "fedpft", "method_params": mp}
    torch.manual_seed(0)
    method = FedPFT(prompt_adapter(build_backbone("resnet8_pft_mini")), 4, mp)
    final = files["root"] / "f.pt"
    torch.save({"identity": identity("fedpft"), "server": method.strategy.init_state(4),
                "clients": {c: method.client.init_state(c) for c in range(4)}}, final)
    with OnVirtualDevice(strict=True):
        run = load_trained_run(params, identity("fedpft"), files["dataset"], files["partition"], "resnet8_pft_mini",
                               None, final)
        assert run.train.x.device == VIRTUAL
        df = probe_run(run, identity("fedpft"), ProbeSettings(epochs=1), logged=None)
        feats, _, _ = run_features(run, "p_rho")
        w, _ = attention_weights(run, 0, "p_kappa", 3)
    assert df["value"].notna().all() and len(feats) == 24 and w.shape == (3, 4)


def test_transport_plans_run_on_the_device():
    """FedOTP's plans from a run's prompts (final.pt is loaded onto the device) of tokens made there."""
    from fedcore.analysis.transport import run_plans
    from fedcore.engine.loop import to_device
    from fedcore.methods.fedotp import GLOBAL, LOCAL
    from otp_helpers import PIPELINE, build, tiny_clip

    method = build("fedotp", tiny_clip(), n_ctx=4, ot_gamma=0.5)
    g = torch.Generator().manual_seed(3)
    shape = method.model.ctx_global.shape
    final = {"global": {GLOBAL: torch.randn(shape, generator=g)},
             "personal": {c: {LOCAL: torch.randn(shape, generator=g)} for c in range(2)}}
    b = synthetic_bundle(n_train=4, n_test=4)
    with OnVirtualDevice(strict=True):
        method.to(VIRTUAL)
        images, labels = (torch.from_numpy(a[:2]).to(VIRTUAL) for a in (b.test.x, b.test.y))
        with torch.no_grad():
            tokens = method.model.clip.encode_image_tokens(PIPELINE(images))
        plans = run_plans(method, to_device(final, VIRTUAL), tokens, labels, [1, 0])
    assert plans.shape == (2, 16, 2)
