"""The one data path: generic batches with per-sample extras, seeded on-device augmentations."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

import fedcore.train
from conftest import identity, run_params
from fedcore.engine.data import AUGMENTATIONS, DeviceSplit, InputPipeline, crop_flip, iterate_batches
from fedcore.methods.base import BatchableClient
from fedcore.methods.fedvpt import FedVPT
from fedcore.train import train_run


def _split(n: int = 12) -> DeviceSplit:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=g)
    split = DeviceSplit(x, torch.arange(n) % 3)
    split.extras["query"] = torch.arange(n, dtype=torch.float32).view(n, 1) * 10
    return split


def test_batches_carry_their_rows_extras_and_labels():
    split, pipe = _split(), InputPipeline(8, (0.5,) * 3, (0.5,) * 3)
    gen = torch.Generator().manual_seed(3)
    batches = list(iterate_batches(split, torch.arange(12), 5, pipe, gen))
    assert [len(b.y) for b in batches] == [5, 5, 2]
    for b in batches:
        assert torch.equal(b.extras["query"][:, 0], b.index.float() * 10)   # extras follow the shuffled rows
        assert torch.equal(b.y, split.y[b.index])
        assert torch.equal(b.x, pipe(split.x[b.index]))
    assert sorted(torch.cat([b.index for b in batches]).tolist()) == list(range(12))


def test_crop_flip_is_seeded_and_changes_images():
    x = torch.randn(16, 3, 8, 8)
    a = crop_flip(x, torch.Generator().manual_seed(1))
    b = crop_flip(x, torch.Generator().manual_seed(1))
    c = crop_flip(x, torch.Generator().manual_seed(2))
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, x)


def test_augmentation_applies_to_training_batches_only():
    split, pipe = _split(), InputPipeline(8, (0.5,) * 3, (0.5,) * 3)
    train = next(iterate_batches(split, torch.arange(12), 12, pipe, torch.Generator().manual_seed(0), ("crop_flip",)))
    evaluation = next(iterate_batches(split, torch.arange(12), 12, pipe, None, ("crop_flip",)))
    assert not torch.equal(train.x, pipe(split.x[train.index]))
    assert torch.equal(evaluation.x, pipe(split.x))


class AugmentedClient(BatchableClient):
    augment = ("crop_flip",)


class AugmentedVPT(FedVPT):
    client_role = AugmentedClient


def test_an_augmented_run_is_deterministic_and_resumes_exactly(tiny_run_files, tmp_path, monkeypatch):
    monkeypatch.setattr(fedcore.train, "method_class", lambda name: AugmentedVPT)

    def run(out, stop=None):
        out.mkdir(exist_ok=True)
        return train_run(run_params(rounds=3), identity("fedvpt"), tiny_run_files["dataset"],
                         tiny_run_files["partition"], "vit_mini", tiny_run_files["weights"], out / "m.parquet",
                         out / "f.pt", checkpoint_path=out / "ckpt.pt", progress=False, stop_after_round=stop)

    full = run(tmp_path / "a").metrics
    assert run(tmp_path / "b", stop=1) is None
    pd.testing.assert_frame_equal(full, run(tmp_path / "b").metrics)
    monkeypatch.setattr(fedcore.train, "method_class", lambda name: FedVPT)
    plain = run(tmp_path / "c").metrics
    assert not full["value"].equals(plain["value"])                      # the augmentation really ran


def test_an_unknown_augmentation_is_refused_when_the_method_is_built():
    class Bad(FedVPT):
        client_role = type("BadClient", (BatchableClient,), {"augment": ("mixup",)})

    with pytest.raises(ValueError, match=r"method fedvpt: unknown augmentation\(s\) \['mixup'\]"):
        Bad(None, 3)
    assert "crop_flip" in AUGMENTATIONS


class RecordingClient(BatchableClient):
    """Records the first batch and ClientData.base_augment each fit sees."""

    seen: list = []

    def fit(self, cid, state, downlink, data, settings):
        RecordingClient.seen.append((next(data.batches()).x.clone(), data.base_augment))
        return super().fit(cid, state, downlink, data, settings)


class RawClient(RecordingClient):
    def train_augment(self, base):
        return tuple(self.augment), tuple(base)


@pytest.mark.parametrize("client, augment, changed, base", [
    (RecordingClient, [], False, ()),                          # no augment: batches as before
    (RecordingClient, ["crop_flip"], True, ()),                # every method's batches get the experiment's
    (RawClient, ["crop_flip"], False, ("crop_flip",)),        # a client that applies it itself gets the names
])
def test_the_experiments_augment_reaches_every_clients_batches(tiny_run_files, tmp_path, monkeypatch, client,
                                                                augment, changed, base):
    """FedPFT spec §8 A21: one base augmentation for all methods of an experiment, at the engine."""
    def first_batch(method_cls, aug):
        monkeypatch.setattr(fedcore.train, "method_class", lambda name: method_cls)
        RecordingClient.seen = []
        params = {**run_params(rounds=1, participation=0.25), **({"augment": aug} if aug else {})}
        train_run(params, identity("fedvpt"), tiny_run_files["dataset"], tiny_run_files["partition"], "vit_mini",
                  tiny_run_files["weights"], tmp_path / "m.parquet", tmp_path / "f.pt", progress=False)
        return RecordingClient.seen[0]

    plain, _ = first_batch(type("Plain", (FedVPT,), {"client_role": RecordingClient}), [])
    x, seen_base = first_batch(type("Run", (FedVPT,), {"client_role": client}), augment)
    assert plain.shape == x.shape and torch.equal(plain, x) != changed and seen_base == base
