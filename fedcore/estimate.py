"""How long a paper-scale training run takes on one GPU, estimated from measured throughputs.

A run's time is its rounds' local updates, its evaluated rounds and a fixed start-up, each derived from the run's
resolved configuration: rounds, clients and clients per round, local epochs and batch size, each client's train
size and the test sets scored (the partition's own code run on labels of the dataset's known shape), which
backbone each client trains, and what the method does besides its local epochs (an upload pass, a second BCD block,
fine-tuning at evaluation, public-data epochs). Throughputs are measured figures (``RATES``, each with its source);
where a figure is missing the stand-in is named in its source as an assumption, and the estimate is one.

The cluster request of a training job is ``RUNTIME_MARGIN`` times this estimate (``request_minutes``), so the
request and the README's per-paper totals (``benchmarks/estimate_paper.py``) come from the same numbers.
This module reads a resolved configuration (``fedcore.config.Resolved``) but imports nothing of it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedcore.backbones.registry import arch_info
from fedcore.code_inputs import ROOT as CODE_ROOT, code_files, fingerprint
from fedcore.data.facts import dataset_facts
from fedcore.engine.loop import RunSpec
from fedcore.engine.roles import Method
from fedcore.engine.sampling import clients_per_round
from fedcore.memo_file import MemoFile
from fedcore.methods import method_class
from fedcore.partition.make import make_partition
from fedcore.partition.registry import scheme_modules

__all__ = ["Rate", "RATES", "RunShape", "Estimate", "RUNTIME_MARGIN", "STARTUP_S", "run_shape", "estimate",
           "estimate_run", "request_minutes", "arch_class", "client_sizes"]

#: the cluster request is this many times the estimate: the estimate is built from throughputs of random-weight
#: benchmarks without data loading, resizing or checkpoint writes, some of them measured on another GPU (below)
RUNTIME_MARGIN = 2.0
#: seconds a training job spends before its first round (imports ~5 s, weights, dataset and artifacts to the
#: device) and after its last (metrics, final state): an assumption, not measured on a GPU
STARTUP_S = 120.0
#: seconds of every round besides training and evaluation (sampling, aggregation, a small checkpoint): assumed
ROUND_OVERHEAD_S = 1.0
#: the shortest runtime (minutes) a training job asks for: a cluster job also starts Snakemake and its environment
MIN_REQUEST_MINUTES = 15
#: bytes/s a checkpoint is written at (a run's large client state, FedPFT's MoCo queues, is saved every round)
CHECKPOINT_BYTES_PER_S = 1.0e9

H100 = "one NVIDIA H100 80 GB, torch 2.11 + CUDA 13, bf16 autocast, random weights"
H200 = "one NVIDIA H200, torch 2.11 + CUDA 13, bf16 autocast, random weights"


@dataclass(frozen=True)
class Rate:
    """A measured training throughput: images/s of one client's local update of ``method`` at ``batch``."""

    images_per_s: float
    batch: int
    method: str          # the method measured: the reference of the method factors below
    eval_ratio: float    # forward-only (evaluation, upload pass) images/s over training images/s
    source: str          # command, GPU, software; "assumed" where a figure stands in for a missing one
    side: int = 224      # the input side it was measured at (FedPFT's extractors: the dataset's own side)


def _resnet_eval_ratio() -> float:
    """The ResNets' eval/train ratio that makes bench_fedhpl's round formula give the measured 78 s hetres round:
    5 clients (R18, R34, R50, R34, R18) x (10,000 train images + 20,000 upload and test images at ratio x train)."""
    train = {"resnet18": 1727.0, "resnet34": 1016.0, "resnet50": 812.0}
    per_client = [train[a] for a in ("resnet18", "resnet34", "resnet50", "resnet34", "resnet18")]
    train_s = sum(10_000 / t for t in per_client)
    forward_s = 78.0 - train_s                  # the 20,000 forward images of each client
    return sum(20_000 / t for t in per_client) / forward_s


_VIT_B_EVAL = 2141.0 / 621.0
_RESNET_EVAL = _resnet_eval_ratio()
_HPL_VIT = ("DEVIATIONS.md § Measurements, GPU table: `python benchmarks/bench_fedhpl.py --setting hetvit --amp "
            f"--steps 30` (FedHPL's update, CE + KD, batch 16), {H100}, 2026-11-23")
_HPL_RES = ("DEVIATIONS.md § Measurements, GPU table: `python benchmarks/bench_fedhpl.py --setting hetres --amp` "
            f"(FedHPL's update with 3-px pad prompts, batch 16), {H100}; eval ratio backed out of its 78 s round")
_B40 = ("DEVIATIONS.md § Measurements, GPU table: `python benchmarks/bench_train.py --arch vit_base_patch16_224 "
        f"--batch 40 --steps 20 --amp` (FedHPL 1,192 images/s), {H100}; eval ratio: ViT-B's at batch 16 (assumed)")
_PFT = ("DEVIATIONS.md § Measurements, GPU table: `python benchmarks/bench_together.py --clients 40 --steps 25`: 40 "
        f"ResNet-8 clients x 25 steps of 100 at 32 px one by one in 5.19 s (plain CE), {H100}; eval ratio: the "
        "ResNets' (assumed)")

#: (arch class, batch) -> measured throughput. A run's (arch class, batch) takes the entry of the largest measured
#: batch not above its own (a smaller batch is slower per image), else the smallest one's step time (rate_for).
RATES: dict[tuple[str, int], Rate] = {
    ("vit_s16", 16): Rate(630.0, 16, "fedhpl", 1639.0 / 630.0, _HPL_VIT),
    ("vit_b16", 16): Rate(621.0, 16, "fedhpl", _VIT_B_EVAL, _HPL_VIT),
    ("vit_l16", 16): Rate(384.0, 16, "fedhpl", 898.0 / 384.0, _HPL_VIT),
    ("vit_b16", 40): Rate(1192.0, 40, "fedhpl", _VIT_B_EVAL, _B40),
    ("resnet18", 16): Rate(1727.0, 16, "fedhpl", _RESNET_EVAL, _HPL_RES),
    ("resnet34", 16): Rate(1016.0, 16, "fedhpl", _RESNET_EVAL, _HPL_RES),
    ("resnet50", 16): Rate(812.0, 16, "fedhpl", _RESNET_EVAL, _HPL_RES),
    # FedOTP: one step of 32 images, CLIP ViT-B/16, K = 100 classes (the text tower over 2K prompts dominates a
    # step, so it is an upper bound for the smaller K of Office, DomainNet and the few-shot sets)
    ("clip_b16", 32): Rate(32 / 0.030, 32, "fedotp", _VIT_B_EVAL,
                           f"issue 24: FedOTP at paper shapes (`benchmarks/bench_fedotp.py --arch clip_vit_b16 "
                           f"--classes 100`) 30 ms a step, {H200} (no H100 figure); eval ratio: ViT-B's (assumed)"),
    ("resnet8_pft", 100): Rate(40 * 25 * 100 / 5.19, 100, "fedavg", _RESNET_EVAL, _PFT, side=32),
    # one stage more than ResNet-8 in a launch-bound step: 25 % more time, assumed (not measured)
    ("resnet10_pft", 100): Rate(40 * 25 * 100 / 5.19 / 1.25, 100, "fedavg", _RESNET_EVAL,
                                "assumed: ResNet-8's figure (above) with 25 % more time a step", side=32),
    # pFedPT's own ViT (8 blocks of width 128 on 64 tokens of a 32-px image), trained whole from scratch: as small
    # as ResNet-8, so a step is assumed to take ResNet-8's launch-bound 5.19 ms (not measured)
    ("small_32px", 100): Rate(40 * 25 * 100 / 5.19, 100, "fedavg", _RESNET_EVAL,
                              "assumed: ResNet-8's step time (above) for a network of its size at 32 px", side=32),
}

#: cost of a method's local update per image relative to FedHPL's on the same ViT, from one table (ViT-B/16, batch
#: 40, DEVIATIONS.md § Measurements, GPU): images/s FedHPL 1,192 over the method's; SGPT's 1,938 counts both BCD
#: blocks, so an image of an epoch costs two of them. Used for the ViT rates only (measured on a ViT); every other
#: method there costs what FedHPL's update costs (FedHPL's is the slowest measured prompt update but FedAvg's).
VIT_METHOD_COST = {"fedhpl": 1.0, "fedvpt": 1192 / 1846, "fedvpt_d": 1192 / 2367, "local": 1192 / 2395,
                   "sgpt": 2 * 1192 / 1938, "fedavg": 1192 / 1416, "pfedpg": 1192 / 1908, "fedpr": 1192 / 1729}
#: a method that trains a head on frozen features computed once per run (Head-Tune): ViT-B/16, batch 40, head only
HEAD_ONLY_IMAGES_PER_S = 34_612.0
#: methods that make one more forward pass over a client's train data each round to build their upload (per-class
#: logits or prototypes, read from their ``upload``)
UPLOAD_PASS = frozenset({"fedhpl", "fedhe", "fedtgp", "fedgh"})

#: the side of the images a backbone sees where it is the dataset's own (FedPFT's extractors); others: 224
DATASET_SIDE = {"tiny_imagenet": 64}

#: (train, test) images per domain of the datasets whose sizes depend on files we do not ship (facts: None):
#: Office-Caltech10 and DomainNet from spec sgpt §3.3-3.4 (an 80/20 split of the FedBN pickles, derived there from
#: the paper's test sizes); Five-dataset's SVHN, CIFAR-10, notMNIST, Fashion-MNIST, MNIST (notMNIST_small: about
#: 18,700 images split 90/10, fedcore/data/sources.py)
DOMAIN_SIZES: dict[str, list[tuple[int, int]]] = {
    "office_caltech10": [(766, 192), (898, 225), (125, 32), (236, 59)],
    "domainnet": [(2103, 526), (2626, 657), (2476, 619), (4000, 1000), (4867, 1217), (2215, 554)],
    "five_dataset": [(73257, 26032), (50000, 10000), (16850, 1870), (60000, 10000), (60000, 10000)],
}
#: datasets whose domains hold disjoint classes (Five-dataset: each of its datasets its own 10 labels)
DISJOINT_DOMAIN_CLASSES = frozenset({"five_dataset"})


def arch_class(arch: str) -> str:
    """The ``RATES`` class of a registered arch: ViTs by width (a smaller ViT counts as ViT-S), ResNets and CLIP by
    name; an arch without one is an error that names what to add."""
    info = arch_info(arch)
    if info["family"] == "vit":
        if info["dim"] <= 192:   # a small ViT of its own (pFedPT's), not a ViT-S/16 at 224 px
            return "small_32px"
        return "vit_s16" if info["dim"] <= 384 else "vit_b16" if info["dim"] <= 768 else "vit_l16"
    if info["family"] == "clip" and info["dim"] <= 512:
        return "clip_b16"
    if arch in ("resnet18", "resnet34", "resnet50", "resnet8_pft", "resnet10_pft"):
        return arch
    raise KeyError(f"no measured throughput for arch {arch!r}: add its class to fedcore/estimate.py arch_class and "
                   "a measured figure to RATES")


def rate_for(cls: str, batch: int) -> Rate:
    """The rate of arch class ``cls`` at ``batch``: the entry of the largest measured batch not above it; below
    every measured batch, the smallest one's with its step time kept (images/s scaled by the batch ratio: a small
    batch is launch-bound)."""
    batches = sorted(b for c, b in RATES if c == cls)
    if not batches:
        raise KeyError(f"no measured throughput for arch class {cls!r} in fedcore/estimate.py RATES")
    below = [b for b in batches if b <= batch]
    if below:
        return RATES[cls, below[-1]]
    r = RATES[cls, batches[0]]
    return replace(r, images_per_s=r.images_per_s * batch / r.batch, batch=batch,
                   source=f"{r.source}; at batch {batch}: its step time kept")


# ---- a run's shape: what its time depends on ------------------------------------------------------------------


def _synthetic_labels(dataset: str, facts) -> dict[str, np.ndarray]:
    """Labels (and domains, coarse labels) of the dataset's known split sizes, classes in turn: what a partition
    needs to draw the clients' index sets (their sizes do not depend on which image is which)."""
    if dataset in DOMAIN_SIZES:
        disjoint = dataset in DISJOINT_DOMAIN_CLASSES
        per_domain = facts.classes // len(DOMAIN_SIZES[dataset]) if disjoint else facts.classes
        out: dict[str, list] = {"train_y": [], "test_y": [], "train_domain": [], "test_domain": []}
        for d, sizes in enumerate(DOMAIN_SIZES[dataset]):
            offset = d * per_domain if disjoint else 0
            for split, n in zip(("train", "test"), sizes):
                out[f"{split}_y"].append(offset + np.arange(n) % per_domain)
                out[f"{split}_domain"].append(np.full(n, d))
        return {k: np.concatenate(v) for k, v in out.items()}
    if facts.train.size is None:
        raise KeyError(f"no split sizes for dataset {dataset!r}: add them to fedcore/data/facts.py or DOMAIN_SIZES")
    out = {"train_y": np.arange(facts.train.size) % facts.classes, "test_y": np.arange(facts.test.size) % facts.classes}
    if facts.coarse:
        out["train_coarse"], out["test_coarse"] = (y * facts.coarse // facts.classes for y in
                                                   (out["train_y"], out["test_y"]))
    return out


def _sizes_version() -> str:
    """The fingerprints of the code that draws the sizes (this module's closure and every partition scheme)."""
    files = code_files(__name__, *scheme_modules())
    return hashlib.sha256(" ".join(fingerprint(CODE_ROOT / f) for f in files).encode()).hexdigest()


# A paper-scale DAG estimates every training job, and FedOTP's partitions alone take seconds to draw: the sizes are
# kept by partition, in this process and, once ``keep_sizes_in`` names a file, between processes.
_SIZES = MemoFile(_sizes_version)


def keep_sizes_in(file) -> MemoFile:
    """Reuse the partition sizes saved in ``file`` (drawn by the same code) and save there, at exit, those drawn; the
    memo."""
    _SIZES.keep_in(file)
    return _SIZES


def client_sizes(dataset: str, spec: dict, partition_id: str) -> tuple[tuple[int, ...], int, int]:
    """(each client's train size, images of the pooled local test sets, images of the official test split) of a
    partition, drawn by the partition's own code on labels of the dataset's shape (cached per partition)."""
    def draw() -> list:
        facts = dataset_facts(dataset)
        labels = _synthetic_labels(dataset, facts)
        part = make_partition(spec, 0, **labels)
        pooled = len(np.unique(np.concatenate(part.test))) if part.test else 0
        return [[len(t) for t in part.train], pooled, len(labels["test_y"])]

    sizes, pooled, official = _SIZES.get(f"{dataset} {partition_id}", draw)
    return tuple(int(n) for n in sizes), int(pooled), int(official)


@dataclass(frozen=True)
class RunShape:
    """What a run's time depends on, from its resolved configuration."""

    method: str                     # the registered method the run executes
    params: dict[str, Any]          # its params, defaults filled in
    rounds: int
    per_round: int                  # clients sampled each round
    local_epochs: int
    batch: int
    evaluated_rounds: int
    client_train: tuple[int, ...]   # each client's train images
    client_archs: tuple[str, ...]   # each client's arch class
    pooled_test: int                # images of the union of the clients' local test sets
    official_test: int              # images of the official test split when the global test is it, else 0
    personalized: bool              # every client's own model scored on every evaluated round
    frozen_features: bool           # features computed once per run, then a head is trained (Head-Tune)
    side: int                       # the side of the images the backbones see
    public_train: int = 0           # a public dataset's train images (FedMD)
    own_tests_only: bool = False    # global_test none: a personalised model scores its own client's test set only

    @property
    def clients(self) -> int:
        """Number of clients."""
        return len(self.client_train)


def run_shape(resolved, experiment: str, method: str) -> RunShape:
    """The shape of run (experiment, method) of a resolved configuration (``fedcore.config.Resolved``)."""
    exp = resolved.experiments[experiment]
    tp = resolved.train_params(experiment, method)
    cls = method_class(tp["method"])
    params = cls.with_defaults(tp["method_params"])
    fed = tp["federation"]
    sizes, pooled, official = client_sizes(exp["dataset"], exp["partition"], exp["partition_id"])
    own = cls.own_backbone(params)   # pFedPT's own ViT, trained from scratch on every client
    names = exp.get("client_backbones", [exp["backbone"]] * len(sizes))
    arch_of = {b: arch_class(own or resolved.backbones[b]["arch"]) for b in set(names)}  # 100 clients, few archs
    archs = [arch_of[b] for b in names]
    spec = RunSpec(identity={}, federation=fed, optimizer={}, evaluation=tp["evaluation"],
                   final_window=int(tp["final_window"]))
    rounds = int(fed["rounds"])
    public = params.get("public")
    return RunShape(
        method=tp["method"], params=params, rounds=rounds,
        per_round=clients_per_round(len(sizes), float(fed["participation"])),
        local_epochs=int(fed["local_epochs"]), batch=int(fed["batch_size"]),
        evaluated_rounds=sum(spec.evaluated(r) for r in range(1, rounds + 1)),
        client_train=sizes, client_archs=tuple(archs), pooled_test=pooled,
        official_test=official if tp["evaluation"].get("global_test") == "official_test" else 0,
        personalized=bool(cls.evaluator_role.personalized),
        frozen_features=cls.frozen_features is not Method.frozen_features,
        side=int(tp.get("input_size") or DATASET_SIDE.get(exp["dataset"], 32)),
        public_train=dataset_facts(public).train.size if isinstance(public, str) else 0,
        own_tests_only=tp["evaluation"].get("global_test") == "none")


# ---- the estimate ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Seconds of one run on one GPU, by part."""

    train_s: float       # local updates (and a method's other training: public data, fine-tuning at evaluation)
    eval_s: float        # forward-only passes: evaluated rounds, upload passes, features computed once
    overhead_s: float    # start-up, per-round overhead, checkpoints

    @property
    def total_s(self) -> float:
        """The run's estimated seconds."""
        return self.train_s + self.eval_s + self.overhead_s


def _steps_images(n: int, batch: int) -> int:
    """Images a pass over ``n`` costs: whole batches (a last partial batch takes a step of its own)."""
    return math.ceil(n / batch) * batch if n else 0


def _fedrep_cost(shape: RunShape, rate: Rate) -> float:
    """FedRep's epochs per local epoch: its head epochs (a forward through the frozen rest, then the head), then its
    body epochs (fedcore/methods/fedrep.py ``epochs``)."""
    p, e = shape.params, shape.local_epochs
    body = int(p["body_epochs"])
    head = max(e - body, 1) if p["head_epochs"] is None else int(p["head_epochs"])
    return (head / rate.eval_ratio + body) / e


def _method_cost(shape: RunShape, rate: Rate, cls: str) -> float:
    """Seconds per image of the run's local update on arch class ``cls``, relative factors included."""
    m, p = shape.method, shape.params
    factor = VIT_METHOD_COST.get(m, 1.0) if cls.startswith("vit") else 1.0
    # passes per image beyond the measured update, read from each method's code
    if m == "fedem":
        factor *= 4 / 3 * int(p["components"])   # M components, each also scored without gradient (its q)
    elif m == "fedpft":
        factor *= 3.0                            # φ three times a step: the base view, MoCo's query and key
    elif m == "pfedsd":
        factor *= 4 / 3                          # the teacher's forward on every batch
    elif m == "fedrep":
        factor *= _fedrep_cost(shape, rate)
    pixels = (shape.side / rate.side) ** 2 if rate.side != 224 else 1.0   # FedPFT's extractors at the data's side
    return factor * max(pixels, 1.0) / rate.images_per_s


def estimate(shape: RunShape) -> Estimate:
    """Seconds of a run of ``shape`` on one GPU (one H100 unless a rate's source says otherwise)."""
    p, n = shape.params, shape.clients
    scored = shape.pooled_test + shape.official_test   # images one model scores in an evaluated round
    epochs = int(p["revisit_epochs"]) if shape.method == "fedmd" and p["revisit_epochs"] is not None \
        else shape.local_epochs
    train = evals = 0.0
    for c, (size, cls) in enumerate(zip(shape.client_train, shape.client_archs, strict=True)):
        rate = rate_for(cls, shape.batch)
        taken = shape.rounds * shape.per_round / n       # rounds client c takes part in, on average
        fwd = 1.0 / (rate.images_per_s * rate.eval_ratio)   # seconds per image of a forward-only pass
        if shape.frozen_features:   # features of the images once, then only a head trains and scores
            train += taken * epochs * _steps_images(size, shape.batch) / HEAD_ONLY_IMAGES_PER_S
            evals += size * fwd
            if c == 0:
                evals += scored * fwd + shape.evaluated_rounds * scored / HEAD_ONLY_IMAGES_PER_S
            continue
        train += taken * epochs * _steps_images(size, shape.batch) * _method_cost(shape, rate, cls)
        if shape.method in UPLOAD_PASS:
            evals += taken * size * fwd
        if shape.method == "fedmd":   # transfer learning once, then each round a digest and an upload on the subset
            subset = p["public_subset"] or shape.public_train
            train += (int(p["pretrain_epochs"]) * shape.public_train
                      + taken * int(p["digest_epochs"]) * subset) / rate.images_per_s
            evals += taken * subset * fwd
        if shape.method == "fedbabu":   # each evaluated round every client fine-tunes before it is scored
            train += shape.evaluated_rounds * int(p["finetune_epochs"]) * size / rate.images_per_s
        # every client's own model scores the test sets, else one global model; scoring only their own test sets,
        # the clients' models together score the pooled set once (the clients' test sets taken as disjoint)
        if (shape.personalized and not shape.own_tests_only) or c == 0:
            evals += shape.evaluated_rounds * scored * fwd
    overhead = STARTUP_S + shape.rounds * ROUND_OVERHEAD_S
    if "queue_size" in p and p.get("contrastive", True):   # FedPFT's MoCo queues are in every round's checkpoint
        overhead += shape.rounds * n * int(p["queue_size"]) * int(p["con_dim"]) * 4 / CHECKPOINT_BYTES_PER_S
    return Estimate(train, evals, overhead)


def estimate_run(resolved, experiment: str, method: str) -> Estimate:
    """The estimate of run (experiment, method) of a resolved paper-scale configuration."""
    return estimate(run_shape(resolved, experiment, method))


def request_minutes(est: Estimate) -> int:
    """The ``runtime`` (minutes) a training job asks a cluster for: ``RUNTIME_MARGIN`` times the estimate, at least
    ``MIN_REQUEST_MINUTES``."""
    return max(MIN_REQUEST_MINUTES, int(math.ceil(RUNTIME_MARGIN * est.total_s / 60)))
