"""Seeded client sampling: the clients of round r depend only on (seed, r), so resumes are exact."""
from __future__ import annotations

import numpy as np


def clients_per_round(num_clients: int, participation: float) -> int:
    """max(1, round(participation * M)), the usual convention (SGPT: 0.05 * 100 = 5)."""
    if not 0.0 < participation <= 1.0:
        raise ValueError(f"federation.participation must lie in (0, 1], got {participation}")
    return max(1, int(round(participation * num_clients)))


def sample_clients(num_clients: int, participation: float, seed: int, round_idx: int) -> list[int]:
    """Sorted client ids sampled without replacement for one round."""
    m = clients_per_round(num_clients, participation)
    if m == num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, round_idx, 0x5A])
    return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))


def stream_seed(seed: int, round_idx: int, client: int, stream: int = 0) -> int:
    """A 63-bit seed for one (run seed, round, client, stream): independent of execution order."""
    return int(np.random.default_rng([seed, round_idx, client, stream]).integers(0, 2**63 - 1))
