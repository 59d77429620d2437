"""One training run planned from the resolved configuration, before any file exists: who it is, the settings it
trains with, and what it reads (backbones, per-sample artifacts, other datasets). The training rule wires its files
from the plan, the probes rebuild runs from it, and tests build every configured method from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedcore.backbones.registry import UNPINNED, arch_spec
from fedcore.config import run_backbones
from fedcore.methods import method_class

if TYPE_CHECKING:
    from fedcore.config import Resolved
    from fedcore.engine.roles import Method


@dataclass(frozen=True)
class RunPlan:
    """One (experiment, method, seed) at the configuration's scale."""

    identity: dict[str, Any]             # paper, experiment, method, scale, dataset, seed (every metrics row)
    params: dict[str, Any]               # train_run's params: federation, optimizer, method, method_params, ...
    archs: str | list[str]               # train_run's backbone_arch: "arch" or "arch.tag", a list per client_backbones
    backbones: tuple[str, ...]           # the config/backbones.yaml entries whose weights the run loads (none: the
                                         # method trains its own arch, or every backbone is drawn at random)
    sha256: str | None | list[str | None]  # the digest each loaded weight file must have (as ``archs``)
    artifacts: dict[str, str]            # batch extras name -> artifact key, built on ``feature_backbone``
    extra_datasets: dict[str, str]       # role -> dataset name (FedMD's public data)
    feature_backbone: str                # the backbone entry the artifacts are computed with

    @property
    def experiment(self) -> str:
        """The run's experiment."""
        return self.identity["experiment"]

    @property
    def dataset(self) -> str:
        """The concrete dataset the run trains on."""
        return self.identity["dataset"]

    @property
    def method_class(self) -> type["Method"]:
        """The registered method the run executes (a variant's method for a variant)."""
        return method_class(self.params["method"])


def arch_tag(cfg: "Resolved", backbone: str) -> str:
    """'arch' for a backbone with its arch's default weight tag, else 'arch.tag' (train_run builds it so)."""
    entry = cfg.backbones[backbone]
    tag = entry.get("tag")
    return f"{entry['arch']}.{tag}" if tag is not None and tag != arch_spec(entry["arch"]).default_tag else entry["arch"]


def weights_sha256(cfg: "Resolved", backbone: str) -> str | None:
    """The sha256 a backbone's weight file must have: None when not checked (pipeline-pretrained files, entries without
    a ``sha256:`` key), UNPINNED for ``sha256: null`` (refused until pinned)."""
    entry = cfg.backbones[backbone]
    if "pretrain" in entry or "sha256" not in entry:
        return None
    return entry["sha256"] or UNPINNED


def experiment_backbones(cfg: "Resolved", experiment: str) -> tuple[str | list[str], str | None | list[str | None]]:
    """train_run's ``backbone_arch`` and ``backbone_sha256`` for the experiment's runs: one each, or a list (one per
    backbone) when the experiment gives ``client_backbones``."""
    exp = cfg.experiments[experiment]
    names = run_backbones(exp)
    archs = [arch_tag(cfg, b) for b in names]
    digests = [weights_sha256(cfg, b) for b in names]
    return (archs, digests) if "client_backbones" in exp else (archs[0], digests[0])


def method_artifacts(cfg: "Resolved", experiment: str, method: str) -> dict[str, str]:
    """The per-sample artifacts a run of ``method`` in ``experiment`` reads: batch extras name -> artifact key."""
    cls = method_class(cfg.base_method(method))
    return dict(cls.artifacts({**cls.defaults, **cfg.method_params(experiment, method)}))


def plan_run(cfg: "Resolved", experiment: str, method: str, seed: int) -> RunPlan:
    """The plan of one configured run (``method`` may name a variant)."""
    exp = cfg.experiments[experiment]
    if method not in exp["methods"]:
        raise ValueError(f"experiment {experiment!r} does not run method {method!r} at scale {cfg.scale} "
                         f"(its methods: {exp['methods']})")
    cls = method_class(cfg.base_method(method))
    params = {**cls.defaults, **cfg.method_params(experiment, method)}
    names = run_backbones(exp)
    archs, digests = experiment_backbones(cfg, experiment)
    # the method trains its own arch (pFedPT), or every backbone is drawn at random (`scratch: true`): none is loaded
    loads = cls.own_backbone(params) is None and not any(cfg.backbones[b].get("scratch") for b in names)
    return RunPlan(
        identity={"paper": exp["paper"], "experiment": experiment, "method": method, "scale": cfg.scale,
                  "dataset": exp["dataset"], "seed": int(seed)},
        params=cfg.train_params(experiment, method),
        archs=archs,
        backbones=tuple(names) if loads else (),
        sha256=digests,
        artifacts=method_artifacts(cfg, experiment, method),
        extra_datasets=dict(cls.extra_datasets(params)),
        feature_backbone=exp["backbone"],
    )
