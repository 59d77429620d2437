"""One training run end to end: data + partition + backbone + method -> engine -> Parquet metrics."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from fedcore.artifacts import load_artifact
from fedcore.backbones.clip import clip_classnames
from fedcore.backbones.prompted import attention_backend
from fedcore.backbones.registry import build_backbone, prompt_adapter, split_tag
from fedcore.backbones.standin import standin_note
from fedcore.backbones.vit import backbone_info
from fedcore.data.arrays import ArrayDataset, load_bundle
from fedcore.engine.data import DeviceSplit, InputPipeline, cache_features, check_augment
from fedcore.engine.evaluate import EvalSets
from fedcore.engine.loop import RunResult, RunSpec, run_federated
from fedcore.engine.roles import ExtraData, Method
from fedcore.engine.sampling import stream_seed
from fedcore.io import atomic_path, atomic_torch_save
from fedcore.methods import method_class
from fedcore.partition.class_order import prompt_class_names
from fedcore.partition.file import Partition
from fedcore.runtime.determinism import deterministic_kernels
from fedcore.runtime.device import pick_device
from fedcore.runtime.seeding import seed_everything

log = logging.getLogger(__name__)


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


def weight_records(archs: Sequence[str], weights: Sequence[str | Path | None]) -> list[dict[str, Any]]:
    """What each backbone of a run loads (arch, file, and the random stand-in's note where it is one: scale smoke),
    logged, and kept in final.pt; a stand-in is logged as a warning, since such a run is not a result."""
    out = []
    for arch, path in zip(archs, weights, strict=True):
        note = standin_note(path)
        out.append({"arch": arch, "weights": None if path is None else str(path), "random_standin": note})
        if note is not None:
            log.warning("backbone %s: RANDOM stand-in weights %s (seed %s) in place of %s: this run is not a result",
                        arch, path, note["seed"], note["replaces"] or "a missing weight file")
        else:
            log.info("backbone %s: %s", arch, "random init from the run's seed (no weight file)" if path is None
                     else f"weights {path}")
    return out


@dataclass(frozen=True)
class RunFiles:
    """The files one run reads (the training rule's inputs): dataset, partition, one weight file per backbone (None:
    drawn at random) with the sha256 each must have (None: not checked), per-sample artifacts and extra datasets."""

    dataset: str | Path
    partition: str | Path
    weights: tuple[str | Path | None, ...] = (None,)
    sha256: tuple[str | None, ...] = (None,)
    artifacts: dict[str, str | Path] = field(default_factory=dict)
    extra_datasets: dict[str, str | Path] = field(default_factory=dict)

    def reads(self) -> list[str | Path]:
        """Every file the run reads (a checkpoint older than one of them is not resumed)."""
        return [self.dataset, self.partition, *(w for w in self.weights if w is not None), *self.artifacts.values(),
                *self.extra_datasets.values()]


@dataclass
class BuiltRun:
    """A run ready for the engine: its method on the device, data, each client's indices, evaluation sets, input
    pipeline and settings; ``weights``: what each backbone loaded (kept in final.pt)."""

    method: Method
    train: DeviceSplit
    test: DeviceSplit
    train_idx: list[torch.Tensor]
    eval_sets: EvalSets
    pipeline: InputPipeline
    spec: RunSpec
    client_weights: list[float] | None
    weights: list[dict[str, Any]]
    device: torch.device


def build_run(params: dict[str, Any], identity: dict[str, Any], archs: str | list[str], files: RunFiles,
              device: torch.device, cache_frozen_features: bool = True, compile: str | None = None) -> BuiltRun:
    """Build one run from its params (Resolved.train_params) and files, as training runs it: the backbones (seeded),
    the method and its models on ``device``, the data with its artifacts, splits and evaluation sets, and the
    run's settings. ``cache_frozen_features``: a head-only method's batches carry its frozen features (training);
    False keeps images (probes that run the whole model). ``compile``: torch.compile mode of the one-pass step on
    CUDA (None: eager)."""
    bundle = load_bundle(files.dataset)
    part = Partition.load(files.partition)
    check_partition(part, len(bundle.train), len(bundle.test), str(files.partition))
    archs = list(archs) if isinstance(archs, (list, tuple)) else [archs]
    # (None,): every backbone is drawn at random (scratch backbones; the seeded init below)
    weights = list(files.weights) if files.weights != (None,) else [None] * len(archs)
    digests = list(files.sha256) if len(files.sha256) != 1 else list(files.sha256) * len(weights)
    if len(digests) != len(weights):
        raise ValueError(f"{len(weights)} weight files but {len(digests)} sha256 digests: give one per file")
    client_backbones = params.get("client_backbones")
    cls = method_class(params.get("method", identity["method"]))
    own = cls.own_backbone(cls.with_defaults(params.get("method_params")))
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
    nets = [build_backbone(arch, w, tag, input_size=input_size, sha256=d)
            for (arch, tag), w, d in zip(map(split_tag, archs), weights, digests, strict=True)]
    loaded = weight_records(archs, weights)
    infos = [backbone_info(n) for n in nets]
    inputs = {(i["img_size"], i["mean"], i["std"]) for i in infos}
    if len(inputs) != 1:
        raise ValueError(f"the run's backbones {archs} expect different inputs {sorted(inputs)}: one run feeds "
                         "every client the same model input")
    backbones = [prompt_adapter(n).to(device) for n in nets]  # the family's frozen, promptable wrapper
    method = cls(backbones if len(backbones) > 1 else backbones[0], bundle.num_classes,
                 params.get("method_params", {}), client_backbones,
                 class_names=prompt_class_names(clip_classnames(bundle.meta), part.class_order))
    method.to(device)

    train = DeviceSplit.from_arrays(bundle.train, device)
    test = DeviceSplit.from_arrays(bundle.test, device)
    declared = cls.artifacts(method.params)
    missing = sorted(set(declared) - set(files.artifacts))
    if missing:
        raise ValueError(f"method {cls.name} reads the per-sample artifacts {missing}; no file was given for them "
                         "(rule features builds them)")
    for name, key in declared.items():
        train.extras[name], test.extras[name] = load_artifact(key, files.artifacts[name], len(bundle.train),
                                                              len(bundle.test), device)
    info = infos[0]
    pipeline = InputPipeline(info["img_size"], info["mean"], info["std"])
    for role, path in _extra_datasets(cls.extra_datasets(method.params), files.extra_datasets, cls.name).items():
        extra = load_bundle(path)
        method.attach_dataset(role, ExtraData(DeviceSplit.from_arrays(extra.train, device), extra.num_classes,
                                              pipeline))
    extractor = method.frozen_features() if cache_frozen_features else None
    augment = tuple(params.get("augment", ()))
    check_augment(augment, "the experiment's key 'augment'")
    if augment and extractor is not None:
        raise ValueError(f"the experiment's key 'augment' = {list(augment)}: method {cls.name} trains on cached "
                         "frozen features, which no augmentation reaches; run it without augment")
    if extractor is not None:
        # features that nothing trained can change are computed once, not every epoch and round
        bs = int(params.get("evaluation", {}).get("batch_size", 256))
        with attention_backend(device):
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
                                  "backbones": archs}, compile=compile)
    return BuiltRun(method, train, test, train_idx, eval_sets, pipeline, spec, agg_weights, loaded, device)


def train_run(params: dict[str, Any], identity: dict[str, Any], dataset_path: str | Path,
              partition_path: str | Path, backbone_arch: str | list[str],
              backbone_weights: str | Path | None | list[str | Path | None],
              metrics_out: str | Path, final_out: str | Path, checkpoint_path: str | Path | None = None,
              device: str = "auto", threads: int | None = None, progress: bool = True,
              stop_after_round: int | None = None, artifacts: dict[str, str | Path] | None = None,
              depends_on: Sequence[str | Path] = (),
              extra_datasets: dict[str, str | Path] | None = None,
              backbone_sha256: str | None | list[str | None] = None, compile: str | None = None,
              deterministic: bool = True) -> RunResult | None:
    """Train one (experiment, method, seed) and write its metrics Parquet and final state atomically.

    ``params['method']`` names the registered method when the run's method is a variant of it
    (e.g. identity method ``sgpt_share_only`` runs ``sgpt`` with the variant's params).
    ``backbone_arch``/``backbone_weights`` may list several backbones; ``params['client_backbones'][c]``
    then says which one client c uses. ``artifacts`` maps each per-sample artifact the method declares
    (``Method.artifacts``) to its file (rule ``features``). ``extra_datasets`` maps each other dataset bundle the
    method declares (``Method.extra_datasets``, e.g. FedMD's public data) to its .npz file.
    ``backbone_sha256`` (one per weight file, as ``backbone_weights``) is the digest each file must have
    (registry.check_sha256; None = not checked). ``deterministic``: on CUDA, deterministic kernels only
    (fedcore/runtime/determinism.py; the CPU's already are).

    The per-round checkpoint outlives the run: when Snakemake is interrupted while the job runs, the job
    still finishes, Snakemake then deletes its outputs as incomplete and reruns it, and the rerun rebuilds
    them from the last checkpoint instead of training again. A checkpoint older than a file the run reads
    (dataset, partition, weights, artifacts, and ``depends_on``: the job's code) is not resumed.
    """
    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    files = RunFiles(dataset_path, partition_path,
                     tuple(backbone_weights) if isinstance(backbone_weights, list) else (backbone_weights,),
                     tuple(backbone_sha256) if isinstance(backbone_sha256, list) else (backbone_sha256,),
                     dict(artifacts or {}), dict(extra_datasets or {}))
    with deterministic_kernels(dev, deterministic):
        run = build_run(params, identity, backbone_arch, files, dev, compile=compile)
        with attention_backend(dev):
            result = run_federated(run.method, run.train, run.test, run.train_idx, run.eval_sets, run.pipeline,
                                   run.spec, checkpoint_path, stop_after_round=stop_after_round, progress=progress,
                                   checkpoint_inputs=[*files.reads(), *depends_on], client_weights=run.client_weights)
    if result is None:
        return None
    atomic_torch_save({"identity": identity, "global": result.global_state, "personal": result.personal_states,
                       "server": result.server_state, "clients": result.client_states,
                       "backbone_weights": run.weights}, final_out)
    with atomic_path(metrics_out, suffix=".parquet") as tmp:
        result.metrics.to_parquet(tmp, index=False)
    return result
