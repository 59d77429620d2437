"""Host-device syncs in training's per-step code, counted on the CPU (tests/host_syncs.py): what a CUDA step would
wait for the GPU on. Each case failed before its sync was removed (the numbers are unchanged: tests of the methods)."""
from __future__ import annotations

import pytest
import torch

from host_syncs import HostSyncs
from otp_helpers import build, tiny_clip

torch.set_num_threads(1)


@pytest.mark.parametrize("method", ["coop", "promptfl", "fedotp"])
def test_a_prompted_text_pass_reads_nothing_back(method):
    """A CLIP-prompt step: the text tower's cut length and CLIP's logit scale are read once, not at every step
    (were 2 reads a step; FedOTP's OT reads its stop test every few iterations, tests/test_ot.py)."""
    m = build(method, tiny_clip(), n_ctx=4)
    model = m.model
    tokens = torch.randn(3, 17, 24)
    model(tokens).sum().backward()  # the first step may read the frozen scale once
    with HostSyncs() as syncs:
        model(tokens).sum().backward()
    allowed = 0 if method != "fedotp" else 100 // 4 + 1  # OT: at most one stop read per STOP_CHECK_EVERY iterations
    assert syncs.counts["scalar"] <= allowed and syncs.total - syncs.counts["scalar"] == 0, dict(syncs.counts)


def test_add_counts_is_bincount_without_a_sync():
    from fedcore.engine.aggregation import add_counts

    labels = torch.tensor([3, 0, 3, 1, 3])
    for dtype in (torch.long, torch.float32, torch.float64):
        counts = torch.arange(5, dtype=dtype)
        with HostSyncs() as syncs:
            add_counts(counts, labels)
        assert syncs.total == 0
        assert torch.equal(counts, torch.arange(5, dtype=dtype) + torch.bincount(labels, minlength=5).to(dtype))


def test_sgpt_batch_vote_stays_on_the_device():
    """Feature shift's batch vote (every sample takes the batch's most selected group): no read back per step."""
    from fedcore.methods.sgpt import assign

    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(8, 16, generator=g), torch.randn(4, 16, generator=g)
    params = {"batch_vote": True, "calibration_eps": 1e-3, "query_relu": False}
    with HostSyncs() as syncs:
        groups, _ = assign(queries, keys, params, None, train=True)
    assert syncs.total == 0, dict(syncs.counts)
    plain, _ = assign(queries, keys, {**params, "batch_vote": False}, None, train=True)
    assert torch.equal(groups, torch.full_like(plain, int(torch.bincount(plain, minlength=4).argmax())))


def test_a_training_batchs_cpu_draws_reach_the_device_without_waiting():
    """The shuffle order and the augmentation draws come from the client's CPU generator every step: copied to the
    device without blocking (a blocking copy waits for all the GPU's queued work). On tests/virtual_device.py's
    second device, since on the CPU a copy to the CPU is no copy."""
    from fedcore.engine.data import DeviceSplit, InputPipeline, iterate_batches
    from virtual_device import VIRTUAL, OnVirtualDevice

    with OnVirtualDevice(strict=True):
        split = DeviceSplit(torch.randint(0, 255, (8, 8, 8, 3), dtype=torch.uint8).to(VIRTUAL),
                            torch.arange(8).to(VIRTUAL))
        indices, pipeline = torch.arange(8).to(VIRTUAL), InputPipeline(8, (0.5,) * 3, (0.5,) * 3)
        with HostSyncs() as syncs:
            batches = list(iterate_batches(split, indices, 4, pipeline, generator=torch.Generator().manual_seed(0),
                                           augment=("crop_flip",)))
    assert len(batches) == 2 and batches[0].x.device == VIRTUAL
    assert syncs.counts["blocking_copy"] == 0, dict(syncs.counts)
