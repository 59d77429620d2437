"""pFedPG: per-client generated prompts, the generator's first-order step, evaluation states, end-to-end runs."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from conftest import identity, run_params
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import build_vit
from fedcore.methods import method_class
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData
from fedcore.engine.roles import FitResult, RoundInfo, module_state
from fedcore.methods.pfedpg import GENERATOR, PROMPT, generate
from fedcore.train import train_run

M = 5  # clients in the unit tests


def _method(**params):
    torch.manual_seed(0)
    return method_class("pfedpg")(PromptedViT(build_vit("vit_mini")), 4, params)


def _client(cid: int) -> ClientData:
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 4
    return ClientData(cid, len(y), lambda: iter([Batch(x, y, torch.arange(8), {})]), torch.Generator())


def _setup(method) -> dict:
    """The server state for M clients, its generator drawn after seeding 1."""
    torch.manual_seed(1)
    server = method.strategy.init_state(M)
    ups = [FitResult(c, 8, up, {}) for c in range(M) if (up := method.client.setup(c, _client(c))) is not None]
    if ups:
        method.strategy.setup(server, ups)
    return server


def _shared(method) -> list[str]:
    return method.client.shared_keys(method.keys(0))


def _personal(method) -> list[str]:
    return method.client.personal_keys(method.keys(0))


def _eval_state(method, cid: int, server: dict, personal: dict, data: ClientData) -> dict:
    """The tensors of the model that scores client ``cid`` (its personal tensors ``personal``)."""
    method.evaluator.load(method.model, cid, server, {"model": personal}, data)
    return module_state(method.model, method.keys(cid))


def test_generated_prompts_differ_per_client_and_start_each_update():
    method = _method(num_prompts=3)
    server = _setup(method)
    gen = generate(server, list(range(M)))
    assert gen.shape == (M, 3, 64)  # K = 3 prompts, vit_mini's embed_dim
    flat = gen.flatten(1)
    dist = torch.cdist(flat, flat)
    assert (dist + torch.eye(M)).min() > 1e-4  # every pair of clients gets different prompts
    for c in range(M):
        method.client.start(method.model, c, method.client.init_state(c), method.strategy.configure(server, c))
        start = module_state(method.model, method.keys(c))
        assert torch.allclose(start[PROMPT], gen[c], atol=1e-7)
    assert _shared(method) == [PROMPT]
    assert set(_personal(method)) == {"head.weight", "head.bias", PROMPT}
    assert set(_personal(_method(eval_prompts="generated"))) == {"head.weight", "head.bias"}


def test_one_generated_prompt_is_still_personal_over_the_papers_ten_basis_tokens():
    """K = 1 (SGPT's prompt length) queries P_base's 10 tokens (the paper's size), so clients get their own prompt
    and their descriptors a gradient; a one-token basis would make the softmax 1: one prompt P_base W^V W^O for
    every client and no descriptor gradient (documented: why ``base_prompts`` is not tied to ``num_prompts``)."""
    method = _method()
    server = _setup(method)
    gen = generate(server, list(range(M)))
    assert gen.shape == (M, 1, 64) and server["prompt_base"].shape == (10, 64)
    flat = gen.flatten(1)
    assert (torch.cdist(flat, flat) + torch.eye(M)).min() > 1e-4
    phi = {k: server[k].clone().requires_grad_(True) for k in GENERATOR}
    (g_desc,) = torch.autograd.grad(generate(phi, [0, 1]).square().sum(), [phi["descriptors"]])
    assert g_desc[[0, 1]].abs().sum(dim=(1, 2)).min() > 0
    tied = _setup(_method(base_prompts=1))
    gen = generate(tied, list(range(M)))
    want = tied["prompt_base"] @ tied["w_v"] @ tied["w_o"]
    assert torch.allclose(gen, want.expand(M, 1, 64), atol=1e-7)
    phi = {k: tied[k].clone().requires_grad_(True) for k in GENERATOR}
    (g_desc,) = torch.autograd.grad(generate(phi, [0, 1]).square().sum(), [phi["descriptors"]])
    assert torch.equal(g_desc, torch.zeros_like(g_desc))


def test_generator_init_is_seeded_on_the_cpu_with_the_documented_draws():
    """d ~ N(0, 1), P_base with VPT's uniform init, W's xavier-uniform (lk = lv = attn_dim): the same tensors for
    the same seed, whatever the device; the six tensors are the whole generator."""
    method = _method(num_prompts=4, attn_dim=16)
    a, b = _setup(method), _setup(method)
    for k in GENERATOR:
        assert torch.equal(a[k], b[k]), k
    assert a["descriptors"].shape == (M, 4, 64) and a["prompt_base"].shape == (10, 64)
    assert [tuple(a[k].shape) for k in ("w_q", "w_k", "w_v", "w_o")] == [(64, 16)] * 3 + [(16, 64)]
    bound = math.sqrt(6 / (64 + 16))
    for k in ("w_q", "w_k", "w_v", "w_o"):
        assert a[k].abs().max() <= bound and a[k].abs().max() > 0.8 * bound, k
    patch = method.model.backbone.patch_size
    assert a["prompt_base"].abs().max() <= math.sqrt(6 / (3 * patch * patch + 64))
    assert abs(float(a["descriptors"].std()) - 1.0) < 0.1
    assert method.params["attn_dim"] == 16 and _method().params["attn_dim"] == 64


def test_generator_step_moves_generated_prompts_toward_the_adapted_ones():
    method = _method(num_prompts=2)
    assert method.params["gen_lr"] == 0.001  # the paper's alpha
    server = _setup(method)
    before = {k: server[k].clone() for k in GENERATOR}
    cids, sizes = [0, 3], [30.0, 10.0]
    torch.manual_seed(2)
    adapted = generate(server, cids) + 0.2 * torch.randn(2, 2, 64)
    results = [FitResult(c, int(n), {"model": {PROMPT: adapted[i]}}, {}) for i, (c, n) in enumerate(zip(cids, sizes))]
    server = method.strategy.aggregate(RoundInfo(1, M, 0.4, 0), {**server, "model": {PROMPT: torch.zeros(2, 64)}},
                                       results)
    glob = server["model"]

    dist_before = (generate(before, cids) - adapted).flatten(1).norm(dim=1)
    dist_after = (generate(server, cids) - adapted).flatten(1).norm(dim=1)
    assert (dist_after < dist_before).all(), (dist_before, dist_after)

    # the step is one SGD step on sum_n w_n/2 ||G(d_n) - P~_n||^2, w_n = N_n / mean(N): recompute it by hand
    phi = {k: before[k].clone().requires_grad_(True) for k in GENERATOR}
    w = torch.tensor(sizes) / torch.tensor(sizes).mean()
    loss = (0.5 * w.view(-1, 1, 1) * (generate(phi, cids) - adapted) ** 2).sum()
    grads = torch.autograd.grad(loss, list(phi.values()))
    for k, g in zip(GENERATOR, grads):
        assert torch.allclose(server[k], before[k] - 0.001 * g, atol=1e-7), k
        assert not torch.equal(server[k], before[k]), k
    # clients that did not upload keep their descriptors; they are marked as not seen
    for c in (1, 2, 4):
        assert torch.equal(server["descriptors"][c], before["descriptors"][c])
    assert server["seen"].tolist() == [True, False, False, True, False]
    # the global state is a summary: the mean generated prompt over all clients
    assert torch.allclose(glob[PROMPT], generate(server, list(range(M))).mean(0))


def test_eval_state_uses_adapted_prompts_once_sampled_and_generated_prompts_before():
    method = _method()
    server = _setup(method)
    glob = {PROMPT: torch.zeros(1, 64)}
    personal = {"head.weight": torch.ones(4, 64), "head.bias": torch.zeros(4), PROMPT: torch.full((1, 64), 7.0)}
    server["seen"][1] = True
    server["model"] = glob
    seen = _eval_state(method, 1, server, personal, _client(1))
    never = _eval_state(method, 2, server, personal, _client(2))
    assert torch.equal(seen[PROMPT], personal[PROMPT])
    assert torch.equal(never[PROMPT], generate(server, [2])[0])
    assert torch.equal(seen["head.weight"], personal["head.weight"])
    assert torch.equal(never["head.bias"], personal["head.bias"])  # its own (initial) head, not a global one

    gen_only = _method(eval_prompts="generated")
    server2 = _setup(gen_only)
    server2["seen"][:] = True
    out = _eval_state(gen_only, 1, {**server2, "model": glob}, personal, _client(1))
    assert torch.equal(out[PROMPT], generate(server2, [1])[0])
    with pytest.raises(ValueError, match="eval_prompts must be adapted|generated"):
        _method(eval_prompts="last")


# ---- end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_files(learnable_run_files):
    return learnable_run_files


def _train(files, work, rounds=3, stop=None, ckpt=False, **fed):
    work.mkdir(exist_ok=True)
    params = run_params(rounds=rounds, participation=1.0, local_epochs=2, **fed)
    params["optimizer"]["lr"] = 0.01
    return train_run(params, identity("pfedpg"), files["dataset"], files["partition"], "vit_mini", files["weights"],
                     work / "m.parquet", work / "f.pt", checkpoint_path=(work / "ckpt.pt") if ckpt else None,
                     progress=False, stop_after_round=stop)


def test_end_to_end_learns_and_is_deterministic(trained_files, tmp_path):
    a = _train(trained_files, tmp_path / "a")
    b = _train(trained_files, tmp_path / "b")
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    m = a.metrics
    assert all(math.isfinite(v) for v in m["value"])
    last = m[(m.client == -1) & (m["round"] >= 2)]
    assert last[last.metric == "acc_mean"]["value"].mean() > 0.5  # 4 classes: chance is 0.25
    assert last[(last.split == "global") & (last.metric == "acc")]["value"].mean() > 0.5
    assert set(a.server_state) >= set(GENERATOR) and a.server_state["seen"].all()
    heads = torch.stack([a.personal_states[c]["head.weight"] for c in range(4)])
    assert (heads - heads.mean(0)).abs().amax(dim=(1, 2)).min() > 0  # heads stay personal, never averaged
    assert set(a.global_state) == {PROMPT}


def test_batched_clients_equal_one_by_one_and_resume_is_exact(trained_files, tmp_path, monkeypatch):
    """pFedPG opts into the engine's batched training (per-client generated starts) and its generator lives
    in the checkpointed server state."""
    from fedcore.engine import loop

    full = _train(trained_files, tmp_path / "full", rounds=3)
    assert _train(trained_files, tmp_path / "cut", rounds=3, stop=2, ckpt=True) is None
    resumed = _train(trained_files, tmp_path / "cut", rounds=3, ckpt=True)
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
    for k in GENERATOR:
        assert torch.equal(full.server_state[k], resumed.server_state[k]), k

    assert loop._why_not_together(_method()) is None  # pFedPG's clients do train together by default
    monkeypatch.setattr(loop, "_why_not_together", lambda method: "forced one by one")
    one = _train(trained_files, tmp_path / "one", rounds=3)
    a, b = full.metrics, one.metrics
    pd.testing.assert_frame_equal(a.drop(columns="value"), b.drop(columns="value"))
    assert abs(a["value"].to_numpy() - b["value"].to_numpy()).max() < 1e-4
    for k in GENERATOR:
        # float reassociation in the batched matmuls, summed over 4 clients' signals: ~3e-5 after 3 rounds
        assert torch.allclose(full.server_state[k], one.server_state[k], atol=1e-4), k


# ---- FedHPL's setting (spec fedhpl §2, §5; Table 5) ------------------------------------------------------
def test_local_epochs_param_overrides_the_experiments_and_trains_one_by_one():
    from fedcore.engine.batching import epochs_of_loss
    from fedcore.engine.optim import TrainSettings

    method = _method(local_epochs=3)
    model = method.model
    assert "one pass" in method.client.together("cpu", model).how        # its own epochs: in one pass only
    assert "vmap" in epochs_of_loss(method.client, "cpu", model, epochs=None).how   # the experiment's: vmap too
    calls = []
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 4
    data = ClientData(0, 8, lambda: calls.append(1) or iter([Batch(x, y, torch.arange(8), {})]), torch.Generator())
    server = _setup(method)
    method.client.fit(0, method.client.init_state(0), method.strategy.configure(server, 0), data,
                      TrainSettings(1, 8, {"name": "sgd", "lr": 0.01}))
    assert len(calls) == 3                                                # 3 epochs, not the experiment's 1


def test_fedhpl_setting_counts_match_table5_where_the_paper_defines_them():
    """10 shallow prompts + head on ViT-B/16 (meta device): F2 − G2 and the 7.5 K upload are exact; the paper's
    G2 (1.512 M) has no published size, so ours (M·K·l + K·l + 4·l·lk) is reported, not matched."""
    from fedcore.backbones.registry import build_backbone, prompt_adapter

    for classes, printed_f2 in ((10, 1.526), (100, 1.592)):
        with torch.device("meta"):
            method = method_class("pfedpg")(prompt_adapter(build_backbone("vit_base_patch16_224")), classes,
                                            {"num_prompts": 10, "local_epochs": 5})
            server = method.strategy.init_state(M)
        model = method.model
        client_side = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert client_side == 10 * 768 + 768 * classes + classes
        uploaded = sum(dict(model.named_parameters())[k].numel() for k in method.client.shared_keys(method.keys(0)))
        assert uploaded == 7680 and uploaded / 1024 == 7.5                    # "only 7.5K parameters"
        assert math.floor((1.512 + client_side / 2**20) * 1000) / 1000 == printed_f2  # F2 = G2 + prompts + head
        ours = sum(server[k].numel() for k in GENERATOR)
        assert ours == M * 10 * 768 + 10 * 768 + 4 * 768 * 64 == 242_688    # 0.231 M ≠ 1.512 M
