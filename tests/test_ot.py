"""FedOTP's OT solvers (spec fedotp §1.6, §1.12, §9): against POT's oracles, early-stopped marginals, the official
code's batch-wide stop, batching, the Wasserstein identity, and the underflow guard."""
from __future__ import annotations

import numpy as np
import ot
import pytest
import torch

from fedcore.methods.ot import _iterate, _solve, sinkhorn, unbalanced_ot

M, N = 196, 2


def _costs(*lead: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """1 - cosine similarities like CLIP's patch-text ones (about 0.22 +- 0.04), shape (*lead, M, N)."""
    g = torch.Generator().manual_seed(seed)
    return (1 - (0.22 + 0.04 * torch.randn(*lead, M, N, generator=g, dtype=torch.float64))).to(dtype)


def _spec_reference(C: torch.Tensor, gamma: float, lam: float, eps: float, max_iter: int) -> torch.Tensor:
    """Spec §1.6's batched reference, verbatim: the official code's stop on the mean |dv| over the whole batch."""
    P, M_, N_ = C.shape
    alpha = C.new_full((P, M_), 1.0 / M_)
    beta = C.new_full((P, N_), gamma / N_)
    Q = torch.exp(-C / lam)
    Qa = Q / alpha.unsqueeze(-1)
    QbT = Q.transpose(1, 2) / beta.unsqueeze(-1)
    u, v = torch.ones_like(alpha), torch.ones_like(beta)
    for _ in range(max_iter):
        v_prev = v
        u = torch.clamp(1.0 / torch.bmm(Qa, v.unsqueeze(-1)).squeeze(-1), max=1.0)
        v = 1.0 / torch.bmm(QbT, u.unsqueeze(-1)).squeeze(-1)
        if (v - v_prev).abs().mean() < eps:
            break
    return u.unsqueeze(-1) * Q * v.unsqueeze(1)


@pytest.mark.parametrize("gamma", [1.0, 0.8, 0.5])
@pytest.mark.parametrize("lam", [0.1, 0.05])
def test_converged_unbalanced_ot_is_pots_entropic_partial_wasserstein(gamma, lam):
    C = _costs(2)
    T = unbalanced_ot(C, gamma, lam, eps=1e-14, max_iter=5000)
    a, b = np.full(M, 1 / M), np.full(N, gamma / N)
    for p in range(len(C)):
        ref = ot.partial.entropic_partial_wasserstein(a, b, C[p].numpy(), lam, m=min(gamma, a.sum()),
                                                      numItermax=3000, stopThr=1e-20)
        assert np.abs(T[p].numpy() - ref).max() <= 1e-6 * ref.max()


def test_converged_classical_ot_and_gamma_one_are_pots_sinkhorn():
    C = _costs(2, seed=1)
    a, b = np.full(M, 1 / M), np.full(N, 1 / N)
    for T in (sinkhorn(C, 0.1, eps=1e-14, max_iter=5000), unbalanced_ot(C, 1.0, 0.1, eps=1e-14, max_iter=5000)):
        for p in range(len(C)):
            ref = ot.sinkhorn(a, b, C[p].numpy(), 0.1, numItermax=3000, stopThr=1e-15)
            assert np.abs(T[p].numpy() - ref).max() <= 1e-6 * ref.max()


def test_early_stopped_marginals_and_the_official_batch_stop():
    C = _costs(64, seed=2, dtype=torch.float32)
    T = unbalanced_ot(C, 0.8, 0.1)  # the paper's eps 1e-3, 100 iterations
    assert T.dtype == torch.float32
    assert torch.allclose(T.sum(1), torch.full((64, N), 0.8 / N), rtol=1e-6, atol=0)  # columns exact after a v step
    rows = T.sum(2) * M
    assert rows.max() <= 1 + 1e-3 and rows.max() > 0.999        # <= 1/M up to the early stop; some rows saturate
    assert abs(float(T.sum((1, 2)).mean()) - 0.8) < 1e-6
    converged = unbalanced_ot(C.double(), 0.8, 0.1, eps=1e-14, max_iter=5000)
    gap = (T.double() - converged).abs().max() / converged.max()
    assert 1e-7 < gap < 1e-2                                   # it did stop early, close to the optimum
    official = unbalanced_ot(C.double(), 0.8, 0.1, stop="batch")
    assert torch.allclose(official, _spec_reference(C.double(), 0.8, 0.1, 1e-3, 100), rtol=1e-12, atol=0)


def test_batched_equals_one_by_one_and_keeps_leading_dims():
    C = _costs(3, 5, seed=3, dtype=torch.float32)
    C[1, 2] += 0.3   # a problem of another scale needs another number of iterations
    for solve in (lambda c: unbalanced_ot(c, 0.8, 0.1), lambda c: sinkhorn(c, 0.1)):
        T = solve(C)
        assert T.shape == C.shape
        for i in range(3):
            for k in range(5):
                assert torch.allclose(T[i, k], solve(C[i, k]), rtol=1e-6, atol=0)
    # for one problem the per-problem stop is the official batch stop
    one = _spec_reference(C[1, 2][None].double(), 0.8, 0.1, 1e-3, 100)[0]
    assert torch.allclose(unbalanced_ot(C.double(), 0.8, 0.1)[1, 2], one, rtol=1e-12, atol=0)
    assert not torch.allclose(unbalanced_ot(C.double(), 0.8, 0.1, stop="batch")[1, 2], one, rtol=1e-6, atol=0)


def test_transported_similarity_is_gamma_minus_the_wasserstein_cost():
    sim = 1 - _costs(4, seed=4)
    T = unbalanced_ot(1 - sim, 0.8, 0.1)
    assert torch.allclose((T * sim).sum((1, 2)), 0.8 - (T * (1 - sim)).sum((1, 2)), rtol=0, atol=1e-14)


def test_underflow_is_solved_in_the_log_domain_with_the_same_iterates():
    C = _costs(6, seed=5)
    # where the scaling form is finite, the log-domain iteration is the same sequence of iterates
    for solve in ("unbalanced", "classical"):
        clip, watch, b = (True, False, 0.8) if solve == "unbalanced" else (False, True, 1.0)
        plain = _solve(C, 0.1, 1.0, b, clip, watch, 1e-3, 100, "problem")
        logd = _solve(C, 0.1, 1.0, b, clip, watch, 1e-3, 100, "problem", log_domain=True)
        assert torch.allclose(plain, logd, rtol=1e-10, atol=0)
    # lam = 0.005: exp(-C/lam) ~ exp(-156) is 0 in fp32, so the scaling form gives NaN; fp64 still holds it
    C32 = C.float()
    Q = torch.exp(-C32 / 0.005)
    assert (Q == 0).all()
    assert not torch.isfinite(_iterate(Q, None, 1 / M, 0.8 / N, True, False, 1e-3, 100, "problem")).all()
    T = unbalanced_ot(C32, 0.8, 0.005)
    assert torch.isfinite(T).all()
    assert torch.allclose(T.double(), unbalanced_ot(C, 0.8, 0.005), rtol=1e-3, atol=1e-7)


def test_half_costs_are_solved_in_fp32_and_bad_settings_are_refused():
    C = _costs(2, seed=6, dtype=torch.float16)
    assert unbalanced_ot(C, 0.8, 0.1).dtype == torch.float32
    with pytest.raises(ValueError, match="gamma"):
        unbalanced_ot(C, 1.2, 0.1)
    with pytest.raises(ValueError, match="lam"):
        sinkhorn(C, 0.0)
    with pytest.raises(ValueError, match="stop"):
        sinkhorn(C, 0.1, stop="never")
    with pytest.raises(ValueError, match=r"\(\.\.\., M, N\)"):
        sinkhorn(torch.ones(3), 0.1)


@pytest.mark.parametrize("stop", ["problem", "batch"])
@pytest.mark.parametrize("lam", [0.1, 0.005])  # 0.005: exp(-C/lam) underflows, the log-domain re-solve runs too
def test_the_stop_is_read_every_few_iterations_and_changes_no_plan(stop, lam, monkeypatch):
    """Each read of "is a problem still running?" is a host-device sync on CUDA; a stopped problem stays frozen, so
    reading it every STOP_CHECK_EVERY iterations gives the plans of reading it every iteration, bit for bit."""
    from host_syncs import HostSyncs

    import fedcore.methods.ot as otm

    C = _costs(3, 4, dtype=torch.float32)
    C[0, 0] += torch.linspace(0, 0.5, M)[:, None]  # problems that stop after different numbers of iterations
    monkeypatch.setattr(otm, "STOP_CHECK_EVERY", 1)
    with HostSyncs() as every:
        ref = (unbalanced_ot(C, 0.8, lam, stop=stop), sinkhorn(C, lam, stop=stop))
    monkeypatch.undo()
    with HostSyncs() as few:
        got = (unbalanced_ot(C, 0.8, lam, stop=stop), sinkhorn(C, lam, stop=stop))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert few.counts["scalar"] <= every.counts["scalar"] // otm.STOP_CHECK_EVERY + 6
