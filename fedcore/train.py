"""One training run end to end: data + partition + backbone + method -> engine -> Parquet metrics."""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from fedcore.artifacts import load_artifact
from fedcore.backbones.clip import clip_classnames
from fedcore.partition_fedotp import prompt_class_names
from fedcore.backbones.prompted import attention_backend
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.backbones.vit import backbone_info
from fedcore.data.arrays import ArrayDataset, load_bundle
from fedcore.engine.data import DeviceSplit, InputPipeline, cache_features, check_augment
from fedcore.engine.evaluate import EvalSets
from fedcore.engine.loop import RunResult, RunSpec, run_federated
from fedcore.engine.roles import ExtraData
from fedcore.engine.sampling import stream_seed
from fedcore.io import atomic_path, atomic_torch_save
from fedcore.methods import method_class
from fedcore.partition import Partition

log = logging.getLogger(__name__)


def pick_device(requested: str = "auto") -> torch.device:
    """CUDA when present (or asked for), CPU otherwise; asking for CUDA without one is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was requested but torch.cuda.is_available() is False")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (model initialisation draws from torch's global RNG)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seeding takes 32 bits only
    torch.manual_seed(seed)


def check_partition(part: Partition, n_train: int, n_test: int, where: str) -> None:
    """Indices must fit the dataset they were made for (a stale partition file would silently misindex)."""
    test_len = n_train if part.spec.get("test_from") == "train" else n_test
    for c, (tr, te) in enumerate(zip(part.train, part.test, strict=True)):
        if len(tr) and (tr.max() >= n_train or tr.min() < 0):
            raise ValueError(f"{where}: client {c} train indices exceed the dataset's {n_train} train images")
        if len(te) and (te.max() >= test_len or te.min() < 0):
            raise ValueError(f"{where}: client {c} test indices exceed the dataset's {test_len} images")
        if len(tr) == 0:
            raise ValueError(f"{where}: client {c} has no training data")


def client_weights(rule: str, train: ArrayDataset, part: Partition) -> list[float] | None:
    """Each client's weight in the server's averages: None (the samples it trains on) for ``train_size``; for
    ``domain_size`` its domain's whole train set over the domain's clients (the official SGPT code's weights)."""
    if rule == "train_size":
        return None
    if rule != "domain_size":
        raise ValueError(f"federation.client_weights={rule!r}: expected train_size or domain_size")
    if train.domain is None or part.spec.get("scheme") != "domain":
        raise ValueError("federation.client_weights=domain_size needs a domain partition of a dataset with domain "
                         f"labels (partition scheme {part.spec.get('scheme')!r})")
    per_domain = int(part.spec.get("clients_per_domain", 1))
    out = []
    for c, idx in enumerate(part.train):
        domains = np.unique(train.domain[idx])
        if len(domains) != 1:
            raise ValueError(f"federation.client_weights=domain_size: client {c} trains on domains {domains.tolist()}")
        out.append(float((train.domain == domains[0]).sum()) / per_domain)
    return out


def paired_split(split: DeviceSplit, labels: list[np.ndarray], images: list[np.ndarray] | None
                 ) -> tuple[DeviceSplit, list[torch.Tensor]]:
    """A split and per-client indices into it in which client c's i-th sample is the image ``images[c][i]`` with
    the label ``labels[c][i]`` (a partition's bug_compat_office_labels pairing); with ``images`` None, the split
    itself and ``labels`` (every sample keeps its own image)."""
    dev = split.y.device
    if images is None:
        return split, [torch.as_tensor(a, dtype=torch.long, device=dev) for a in labels]
    lab = torch.as_tensor(np.concatenate(labels), dtype=torch.long, device=dev)
    img = torch.as_tensor(np.concatenate(images), dtype=torch.long, device=dev)
    # one row per (client, sample): per-image data follows the image, labels follow the partition
    out = DeviceSplit(x=split.x[img], y=split.y[lab],
                      features=None if split.features is None else split.features[img],
                      coarse=None if split.coarse is None else split.coarse[lab],
                      extras={k: v[img] for k, v in split.extras.items()})
    ends = np.cumsum([len(a) for a in labels])
    return out, [torch.arange(e - len(a), e, dtype=torch.long, device=dev) for a, e in zip(labels, ends)]


def _extra_datasets(declared: dict[str, str], given: dict[str, str | Path] | None, method: str
                    ) -> dict[str, str | Path]:
    """The files of the extra datasets a method declares; each must be given, and nothing else."""
    given = dict(given or {})
    missing, unknown = sorted(set(declared) - set(given)), sorted(set(given) - set(declared))
    if missing:
        named = ", ".join(f"{r} ({declared[r]})" for r in missing)
        raise ValueError(f"method {method} reads the extra dataset(s) {named}; no file was given for them "
                         "(train_run's extra_datasets)")
    if unknown:
        raise ValueError(f"extra dataset(s) {unknown} were given, but method {method} reads only {sorted(declared)}")
    return {role: given[role] for role in declared}


def train_run(params: dict[str, Any], identity: dict[str, Any], dataset_path: str | Path,
              partition_path: str | Path, backbone_arch: str | list[str],
              backbone_weights: str | Path | None | list[str | Path | None],
              metrics_out: str | Path, final_out: str | Path, checkpoint_path: str | Path | None = None,
              device: str = "auto", threads: int | None = None, progress: bool = True,
              stop_after_round: int | None = None, artifacts: dict[str, str | Path] | None = None,
              depends_on: Sequence[str | Path] = (),
              extra_datasets: dict[str, str | Path] | None = None,
              backbone_sha256: str | None | list[str | None] = None) -> RunResult | None:
    """Train one (experiment, method, seed) and write its metrics Parquet and final state atomically.

    ``params['method']`` names the registered method when the run's method is a variant of it
    (e.g. identity method ``sgpt_share_only`` runs ``sgpt`` with the variant's params).
    ``backbone_arch``/``backbone_weights`` may list several backbones; ``params['client_backbones'][c]``
    then says which one client c uses. ``artifacts`` maps each per-sample artifact the method declares
    (``Method.artifacts``) to its file (rule ``features``). ``extra_datasets`` maps each other dataset bundle the
    method declares (``Method.extra_datasets``, e.g. FedMD's public data) to its .npz file.
    ``backbone_sha256`` (one per weight file, as ``backbone_weights``) is the digest each file must have
    (registry.check_sha256; None = not checked).

    The per-round checkpoint outlives the run: when Snakemake is interrupted while the job runs, the job
    still finishes, Snakemake then deletes its outputs as incomplete and reruns it, and the rerun rebuilds
    them from the last checkpoint instead of training again. A checkpoint older than a file the run reads
    (dataset, partition, weights, artifacts, and ``depends_on``: the job's code) is not resumed.
    """
    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    bundle = load_bundle(dataset_path)
    part = Partition.load(partition_path)
    check_partition(part, len(bundle.train), len(bundle.test), str(partition_path))
    archs = backbone_arch if isinstance(backbone_arch, list) else [backbone_arch]
    # None: every backbone is drawn at random (scratch backbones; the seeded init below)
    weights = (backbone_weights if isinstance(backbone_weights, list)
               else [backbone_weights] * (len(archs) if backbone_weights is None else 1))
    digests = backbone_sha256 if isinstance(backbone_sha256, list) else [backbone_sha256] * len(weights)
    if len(digests) != len(weights):
        raise ValueError(f"{len(weights)} weight files but {len(digests)} sha256 digests: give one per file")
    client_backbones = params.get("client_backbones")
    cls = method_class(params.get("method", identity["method"]))
    own = cls.own_backbone({**cls.defaults, **params.get("method_params", {})})
    input_size = params.get("input_size")  # the side of the images the backbones see, if not their weights'
    if own is not None:  # the method trains its own architecture from scratch: no experiment backbone is loaded
        if input_size is not None:
            raise ValueError(f"method {cls.name} trains its own backbone {own!r} at its own input size: drop "
                             f"input_size={input_size} from its experiment")
        if client_backbones is not None:
            raise ValueError(f"method {cls.name} trains its own backbone {own!r} on every client: drop "
                             f"client_backbones={client_backbones} from its experiment")
        archs, weights, digests = [own], [None], [None]
    if len(archs) != len(weights) or (len(archs) > 1 and client_backbones is None):
        raise ValueError(f"{len(archs)} backbone archs, {len(weights)} weight files and client_backbones="
                         f"{client_backbones}: several backbones need one weight file each and client_backbones")
    if client_backbones is not None and len(client_backbones) != len(part.train):
        raise ValueError(f"client_backbones names {len(client_backbones)} clients, the partition has {len(part.train)}")

    seed = int(identity["seed"])
    # A derived seed for model initialisation: seeding with the bare run seed would reproduce the
    # RNG stream of the backbone's own pretraining (seed 0), so a fresh head would start as the
    # pretraining head and leak its training into the run.
    seed_everything(stream_seed(seed, 0, 0, 0x1A17))
    # "arch" or "arch.tag" (config/backbones.yaml's weight tag: the input contract of the weights)
    nets = [build_backbone(a.partition(".")[0], w, a.partition(".")[2] or None, input_size=input_size, sha256=d)
            for a, w, d in zip(archs, weights, digests, strict=True)]
    infos = [backbone_info(n) for n in nets]
    inputs = {(i["img_size"], i["mean"], i["std"]) for i in infos}
    if len(inputs) != 1:
        raise ValueError(f"the run's backbones {archs} expect different inputs {sorted(inputs)}: one run feeds "
                         "every client the same model input")
    backbones = [prompt_adapter(n).to(dev) for n in nets]  # the family's frozen, promptable wrapper
    method = cls(backbones if len(backbones) > 1 else backbones[0], bundle.num_classes,
                 params.get("method_params", {}), client_backbones,
                 class_names=prompt_class_names(clip_classnames(bundle.meta), part.class_order))
    method.to(dev)

    train = DeviceSplit.from_arrays(bundle.train, dev)
    test = DeviceSplit.from_arrays(bundle.test, dev)
    declared = cls.artifacts(method.params)
    missing = sorted(set(declared) - set(artifacts or {}))
    if missing:
        raise ValueError(f"method {cls.name} reads the per-sample artifacts {missing}; no file was given for them "
                         "(rule features builds them)")
    for name, key in declared.items():
        train.extras[name], test.extras[name] = load_artifact(key, artifacts[name], len(bundle.train),
                                                              len(bundle.test), dev)
    info = infos[0]
    pipeline = InputPipeline(info["img_size"], info["mean"], info["std"])
    for role, path in _extra_datasets(cls.extra_datasets(method.params), extra_datasets, cls.name).items():
        extra = load_bundle(path)
        method.attach_dataset(role, ExtraData(DeviceSplit.from_arrays(extra.train, dev), extra.num_classes, pipeline))
    extractor = method.frozen_features()
    augment = tuple(params.get("augment", ()))
    check_augment(augment, "the experiment's key 'augment'")
    if augment and extractor is not None:
        raise ValueError(f"the experiment's key 'augment' = {list(augment)}: method {cls.name} trains on cached "
                         "frozen features, which no augmentation reaches; run it without augment")
    if extractor is not None:
        # features that nothing trained can change are computed once, not every epoch and round
        bs = int(params.get("evaluation", {}).get("batch_size", 256))
        with attention_backend(dev):
            train, test = (cache_features(s, extractor, pipeline, bs) for s in (train, test))
    source = train if part.spec.get("test_from") == "train" else test
    train, train_idx = paired_split(train, part.train, part.train_images)
    source, test_idx = paired_split(source, part.test, part.test_images)
    evaluation = dict(params.get("evaluation", {}))
    eval_sets = EvalSets(source, test_idx, test, evaluation.get("global_test", "pooled_local"))
    agg_weights = client_weights(params["federation"].get("client_weights", "train_size"), bundle.train, part)
    spec = RunSpec(identity=dict(identity), federation=params["federation"], optimizer=params["optimizer"],
                   evaluation=evaluation, final_window=int(params.get("final_window", 1)), augment=augment,
                   method_params={"method": cls.name, **method.params, "client_backbones": client_backbones,
                                  "backbones": archs})
    reads = [dataset_path, partition_path, *(w for w in weights if w is not None), *(artifacts or {}).values(),
             *(extra_datasets or {}).values(), *depends_on]
    with attention_backend(dev):
        result = run_federated(method, train, test, train_idx, eval_sets, pipeline, spec,
                               checkpoint_path, stop_after_round=stop_after_round, progress=progress,
                               checkpoint_inputs=reads, client_weights=agg_weights)
    if result is None:
        return None
    atomic_torch_save({"identity": identity, "global": result.global_state, "personal": result.personal_states,
                       "server": result.server_state, "clients": result.client_states}, final_out)
    with atomic_path(metrics_out, suffix=".parquet") as tmp:
        result.metrics.to_parquet(tmp, index=False)
    return result
