"""Batched entropic optimal transport between an image's patches and a class's prompts (FedOTP, spec fedotp §1.5-1.6,
§1.12): a helper module of the FedOTP methods, no Method in it.

Each problem is a cost matrix C (M patches x N prompts); a batch is C of shape (..., M, N), every leading index one
independent problem (one per image and class). Patch marginal alpha = 1/M, prompt marginal beta = gamma/N.

* ``unbalanced_ot``: the paper's Algorithm 1 (supplement A, "Efficient Scaling Dykstra"): from u = v = 1, repeat
  u = min(alpha / (Q v), 1), v = beta / (Q^T u) with Q = exp(-C/lam), and stop when the mean |v - v_prev| < eps or
  after ``max_iter`` iterations; T = diag(u) Q diag(v). Its columns sum to beta exactly, its rows to <= alpha
  (at convergence; the early stop leaves a small overshoot), its mass is gamma. Converged, it is POT's
  ``ot.partial.entropic_partial_wasserstein(alpha, beta, C, lam, m=gamma)``.
* ``sinkhorn``: the official code's classical OT (``--OT Sinkhorn``): r = alpha / (Q c), c = (1/N) / (Q^T r), stop
  when the mean |r - r_prev| < eps; T = diag(r) Q diag(c). Converged, it is ``ot.sinkhorn``.

Choices (DEVIATIONS.md, FedOTP):
* The stopping test is per problem by default (``stop="problem"``): each problem stops on the mean over its own N
  (or M) scalings, as Algorithm 1 reads for one problem, so a plan does not depend on the other images and classes
  of its batch. ``stop="batch"`` is the official code's test, one mean over the whole batch: every problem then
  runs as long as the slowest needs on average.
* Precision: fp32 at least (half and bf16 costs are promoted; fp64 stays fp64): exp(-C/lam) underflows in fp16
  (spec §8.6; the official code's NaN).
* Underflow guard: a problem whose plan comes out non-finite (exp(-C/lam) underflows to 0 in fp32 when
  C/lam > ~87, e.g. lam = 0.01) is solved again by the same iteration written in the log domain (log u, log v,
  log-sum-exp), which is the same sequence of iterates, only computed without overflow. Where the scaling form is
  finite both agree to rounding (tests/test_ot.py), so the guard changes no number; it logs a warning.
* No autograd: the plan is a constant of the loss (spec §1.8; the caller passes a detached cost); the solvers run
  under ``torch.no_grad``.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

STOPS = ("problem", "batch")
#: iterations between two reads of "is any problem still running?": each read is a host-device sync on CUDA, and a
#: stopped problem's scalings stay frozen, so iterating past the stop until the next read changes no number
STOP_CHECK_EVERY = 4


def _as_problems(C: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(P, M, N) cost in fp32 or wider, and the leading shape to restore."""
    if C.dim() < 2:
        raise ValueError(f"cost must have shape (..., M, N); got {tuple(C.shape)}")
    dtype = torch.promote_types(C.dtype, torch.float32)
    return C.detach().to(dtype).reshape(-1, *C.shape[-2:]), tuple(C.shape[:-2])


def _check(lam: float, eps: float, max_iter: int, stop: str) -> None:
    """Clear errors for solver settings that cannot work."""
    if not lam > 0:
        raise ValueError(f"entropic regularisation lam must be > 0, got {lam}")
    if not eps > 0 or int(max_iter) < 1:
        raise ValueError(f"eps must be > 0 and max_iter >= 1, got eps={eps}, max_iter={max_iter}")
    if stop not in STOPS:
        raise ValueError(f"stop must be one of {STOPS}, got {stop!r}")


def _iterate(Q: Tensor | None, logQ: Tensor | None, a: float, b: float, clip_rows: bool, watch_rows: bool,
             eps: float, max_iter: int, stop: str) -> Tensor:
    """Alternating row / column scalings of Q (or of exp(logQ), in the log domain) from ones; returns the plan.

    Row step: u = a / (Q v), clipped at 1 when ``clip_rows`` (the patch inequality); column step: v = b / (Q^T u).
    The stop watches the change of u (``watch_rows``) or of v, per problem or over the batch (``stop``)."""
    log_domain = Q is None
    K = logQ if log_domain else Q
    P, M, N = K.shape
    u = K.new_zeros(P, M) if log_domain else K.new_ones(P, M)   # log u = 0 <=> u = 1
    v = K.new_zeros(P, N) if log_domain else K.new_ones(P, N)
    active = torch.ones(P, dtype=torch.bool, device=K.device)
    la, lb = torch.log(K.new_tensor(a)), torch.log(K.new_tensor(b))
    Qt = None if log_domain else Q.transpose(1, 2).contiguous()  # (P, N, M): Q^T u as one batched matvec
    for it in range(int(max_iter)):
        if log_domain:
            u_new = la - torch.logsumexp(logQ + v[:, None, :], dim=2)
            if clip_rows:
                u_new = u_new.clamp(max=0.0)
            v_new = lb - torch.logsumexp(logQ + u_new[:, :, None], dim=1)
            old, new = (u, u_new) if watch_rows else (v, v_new)
            delta = (new.exp() - old.exp()).abs()
        else:
            u_new = a / torch.bmm(Q, v.unsqueeze(2)).squeeze(2)
            if clip_rows:
                u_new = u_new.clamp(max=1.0)
            v_new = b / torch.bmm(Qt, u_new.unsqueeze(2)).squeeze(2)
            delta = (u_new - u).abs() if watch_rows else (v_new - v).abs()
        u = torch.where(active[:, None], u_new, u)
        v = torch.where(active[:, None], v_new, v)
        done = delta.mean(1) < eps if stop == "problem" else (delta.mean() < eps).expand(P)
        active = active & ~done
        if (it + 1) % STOP_CHECK_EVERY == 0 and not bool(active.any()):
            break
    if log_domain:
        return torch.exp(u[:, :, None] + logQ + v[:, None, :])
    return u[:, :, None] * Q * v[:, None, :]


def _solve(C: Tensor, lam: float, a_total: float, b_total: float, clip_rows: bool, watch_rows: bool, eps: float,
           max_iter: int, stop: str, log_domain: bool = False) -> Tensor:
    """The plan of every problem of C (..., M, N), with the underflow guard (module docstring)."""
    _check(lam, eps, max_iter, stop)
    costs, lead = _as_problems(C)
    M, N = costs.shape[-2:]
    a, b = a_total / M, b_total / N
    with torch.no_grad():
        logQ = -costs / lam
        if log_domain:
            T = _iterate(None, logQ, a, b, clip_rows, watch_rows, eps, max_iter, stop)
        else:
            T = _iterate(torch.exp(logQ), None, a, b, clip_rows, watch_rows, eps, max_iter, stop)
            bad = ~torch.isfinite(T).flatten(1).all(1)
            if bool(bad.any()):
                log.warning("optimal transport: %d of %d problems overflow exp(-C/lam) at lam=%g in %s; solved in "
                            "the log domain (same iterates)", int(bad.sum()), len(T), lam, T.dtype)
                # the batch-wide stop couples problems: re-solve all of them so the iteration count stays shared
                redo = torch.ones_like(bad) if stop == "batch" else bad
                T = T.clone()
                T[redo] = _iterate(None, logQ[redo], a, b, clip_rows, watch_rows, eps, max_iter, stop)
    return T.reshape(*lead, M, N)


def unbalanced_ot(C: Tensor, gamma: float, lam: float, eps: float = 1e-3, max_iter: int = 100,
                  stop: str = "problem") -> Tensor:
    """FedOTP's Algorithm 1 on C (..., M, N): plans with rows <= 1/M, columns = gamma/N (module docstring)."""
    if not 0 < gamma <= 1:
        raise ValueError(f"transported mass gamma must be in (0, 1], got {gamma}")
    return _solve(C, lam, 1.0, gamma, clip_rows=True, watch_rows=False, eps=eps, max_iter=max_iter, stop=stop)


def sinkhorn(C: Tensor, lam: float, eps: float = 1e-3, max_iter: int = 100, stop: str = "problem") -> Tensor:
    """Classical entropic OT on C (..., M, N): rows = 1/M, columns = 1/N, the official code's Sinkhorn loop."""
    return _solve(C, lam, 1.0, 1.0, clip_rows=False, watch_rows=True, eps=eps, max_iter=max_iter, stop=stop)
