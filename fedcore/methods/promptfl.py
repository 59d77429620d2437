"""PromptFL: one CoOp prompt shared by all clients, FedAvg."""
from __future__ import annotations

from fedcore.methods import register_method
from fedcore.methods.clip_prompt import ClipPromptMethod


@register_method
class PromptFL(ClipPromptMethod):
    """PromptFL (Guo et al., 2023) as FedOTP's baseline (spec fedotp §4.3): one 16-token unified context (N(0, 0.02^2))
    trained by the sampled clients with CE on CLIP's CLS cosine x logit scale and averaged by training-set size
    (FedAvg); the global prompt is scored on every client's test split.

    Choices ([R] spec §8.11, §8.16; DEVIATIONS.md, FedOTP): the experiment's optimiser, batch, R and T as FedOTP
    (the code's PromptFL configs, lr 0.002 cosine for 200 epochs after a warm-up epoch at 1e-5, are not used);
    clients are sampled from round 1 (``round0_all`` false, as the code's baselines; true trains all clients in
    round 1 as FedOTP does); image tokens cached from the deterministic transform (clip_prompt.py)."""

    name = "promptfl"
