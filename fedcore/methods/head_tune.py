"""Head-Tune: only the linear classifier on the frozen CLS feature, averaged by FedAvg (SGPT Table 1)."""
from __future__ import annotations

from fedcore.methods.base import Method


class HeadTune(Method):
    """Linear probe trained federatedly; everything else is the engine's default."""

    name = "head_tune"
