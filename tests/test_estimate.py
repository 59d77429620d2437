"""The paper-scale time estimate (fedcore/estimate.py): measured rounds reproduced, run shapes from the config, the
cluster request derived from it."""
from __future__ import annotations

from pathlib import Path

import pytest

from fedcore.config import load_config
from fedcore.estimate import (MIN_REQUEST_MINUTES, RATES, RUNTIME_MARGIN, Estimate, RunShape, arch_class,
                              client_sizes, estimate, estimate_run, rate_for, request_minutes, run_shape)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paper():
    return load_config({"scale": "paper", "seeds": [0], "papers": ["sgpt", "fedhpl", "fedotp", "fedpft"],
                        "outputs": "all"}, ROOT)


def one_round(archs: tuple[str, ...]) -> RunShape:
    """One FedHPL round as benchmarks/bench_fedhpl.py estimates it: 5 clients x 10,000 images, an upload pass, the
    10,000 test images scored by each client's model."""
    return RunShape(method="fedhpl", params={}, rounds=1, per_round=5, local_epochs=1, batch=16, evaluated_rounds=1,
                    client_train=(10_000,) * 5, client_archs=archs, pooled_test=10_000, official_test=0,
                    personalized=True, frozen_features=False, side=32)


def test_the_estimate_reproduces_the_measured_fedhpl_rounds():
    """DEVIATIONS.md's H100 rounds: hetvit ~155 s, hetres ~78 s (bench_fedhpl's own formula on its figures)."""
    vit = estimate(one_round(("vit_s16", "vit_b16", "vit_l16", "vit_b16", "vit_s16")))
    res = estimate(one_round(("resnet18", "resnet34", "resnet50", "resnet34", "resnet18")))
    assert vit.train_s + vit.eval_s == pytest.approx(155, abs=1)
    assert res.train_s + res.eval_s == pytest.approx(78, abs=0.5)


def test_every_rate_names_its_source_and_the_batch_lookup_is_conservative():
    assert all(r.source and r.images_per_s > 0 and r.eval_ratio > 1 for r in RATES.values())
    assert rate_for("vit_b16", 50).batch == 40 and rate_for("vit_b16", 32).batch == 16
    slow = rate_for("vit_b16", 8)                      # below every measured batch: the smallest one's step time
    assert slow.batch == 8 and slow.images_per_s == pytest.approx(RATES["vit_b16", 16].images_per_s / 2)
    assert arch_class("vit_base_patch16_224") == "vit_b16" and arch_class("vit_pfedpt") == "small_32px"
    with pytest.raises(KeyError, match="no measured throughput for arch 'resnet_mini_18'"):
        arch_class("resnet_mini_18")


def test_client_sizes_come_from_the_partition_code():
    sizes, pooled, official = client_sizes("cifar10", {"scheme": "dirichlet_per_client", "clients": 40, "alpha": 0.1,
                                                       "train_per_client": 500, "test_per_client": 100}, "pft")
    assert sizes == (500,) * 40 and official == 10_000 and 0 < pooled <= 4000
    sizes, _, _ = client_sizes("office_caltech10", {"scheme": "domain", "clients_per_domain": 1,
                                                    "train_fraction_of_min": 0.5}, "office")
    assert sizes == (62,) * 4                          # spec sgpt §3.3: about 62 train images a client


def test_run_shapes_follow_the_resolved_config(paper):
    sgpt = run_shape(paper, "sgpt_c100_s50", "sgpt")
    assert (sgpt.rounds, sgpt.per_round, sgpt.local_epochs, sgpt.batch, sgpt.clients) == (60, 5, 5, 40, 100)
    assert 12 < sgpt.evaluated_rounds < 60            # round 1, every 5th and the report window
    hetvit = run_shape(paper, "hpl_c10_iid_hetvit", "fedhpl")
    assert hetvit.client_archs == ("vit_s16", "vit_b16", "vit_l16", "vit_b16", "vit_s16")
    assert hetvit.official_test == 10_000 and hetvit.personalized
    tiny = run_shape(paper, "pft_tiny_dir0p1", "fedpft")
    assert tiny.side == 64 and tiny.client_archs[0] == "resnet10_pft"
    # a longer budget costs more, as does a larger backbone
    homo = estimate_run(paper, "hpl_c10_iid_homo", "fedhpl")
    assert estimate_run(paper, "hpl_c10_iid_hetvit", "fedhpl").total_s > homo.total_s
    assert estimate_run(paper, "hpl_c10_iid_homo", "fedavg").total_s > homo.total_s   # 100 rounds against 10


def test_every_paper_run_has_an_estimate_and_the_request_is_its_margin(paper):
    for e, exp in paper.experiments.items():   # one run per experiment: the shapes differ by experiment
        if not exp["methods"]:
            continue
        m = exp["methods"][0]
        est = estimate_run(paper, e, m)
        assert est.total_s > 0
        assert paper.run_resources(e, m)["runtime"] == request_minutes(est)
    assert request_minutes(Estimate(3600.0, 0.0, 0.0)) == 60 * RUNTIME_MARGIN
    assert request_minutes(Estimate(1.0, 0.0, 0.0)) == MIN_REQUEST_MINUTES
    assert paper.at_scale("mini").run_resources("sgpt_c100_s50", "sgpt") == {"gpu": 0, "mem_mb": 2000, "runtime": 10}


def test_a_later_process_reuses_the_drawn_sizes_and_only_for_the_same_code(tmp_path, monkeypatch):
    """A paper-scale DAG draws every partition for the estimates (seconds for FedOTP's): the sizes are saved by
    partition, a later call draws none of them, and a change to the code that draws them (the memo's version, the
    fingerprints of the estimate's and every scheme's code) discards them."""
    from fedcore import estimate as est, memo_file

    monkeypatch.setattr(memo_file.atexit, "register", lambda f: None)
    draws = []
    real = est.make_partition
    monkeypatch.setattr(est, "make_partition", lambda *a, **k: draws.append(a[0]["scheme"]) or real(*a, **k))
    spec = {"scheme": "dirichlet_per_client", "clients": 40, "alpha": 0.1, "train_per_client": 500,
            "test_per_client": 100}
    file = tmp_path / "cache" / "partition_sizes.json"
    version = est._sizes_version()
    for expected_draws, code in ((1, version), (0, version), (1, "other code")):
        monkeypatch.setattr(est, "_SIZES", memo_file.MemoFile(lambda code=code: code))  # a new process
        draws.clear()
        est.keep_sizes_in(file)
        first = client_sizes("cifar10", spec, "pft")
        assert client_sizes("cifar10", spec, "pft") == first and len(draws) == expected_draws
        assert first[0] == (500,) * 40 and first[2] == 10_000
        est._SIZES.save()
    drawing = {str(f) for f in est.code_files(est.__name__, *est.scheme_modules())}  # what the version hashes
    assert {"estimate.py", "partition/make.py", "partition/schemes/fedotp.py", "data/facts.py"} <= drawing
