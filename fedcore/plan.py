"""One training run planned from the resolved configuration, before any file exists: who it is, the settings it
trains with, and what it reads (backbones, per-sample artifacts, other datasets). The training rule wires its files
from the plan, the probes rebuild runs from it, and tests build every configured method from it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fedcore.artifacts import artifact_module
from fedcore.backbones.registry import UNPINNED, arch_spec
from fedcore.config import ConfigError, load_config, read_yaml, run_backbones
from fedcore.methods import method_class, method_module

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

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules the run imports by name besides fedcore.train's imports: its method's and its artifacts'
        (with fedcore.train, the roots of its code inputs: fedcore/code_inputs.py)."""
        artifacts = dict.fromkeys(artifact_module(key) for key in self.artifacts.values())
        return (method_module(self.params["method"]), *artifacts)


def arch_tag(cfg: "Resolved", backbone: str) -> str:
    """'arch' for a backbone with its arch's default weight tag, else 'arch.tag' (train_run builds it so)."""
    entry = cfg.backbones[backbone]
    tag = entry.get("tag")
    return f"{entry['arch']}.{tag}" if tag is not None and tag != arch_spec(entry["arch"]).default_tag else entry["arch"]


def weights_sha256(cfg: "Resolved", backbone: str) -> str | None:
    """The sha256 a backbone's weight file must have: None when not checked (pipeline-pretrained files, random
    stand-ins at scale smoke, entries without a ``sha256:`` key), UNPINNED for ``sha256: null`` (refused until
    pinned)."""
    entry = cfg.backbones[backbone]
    if "pretrain" in entry or "sha256" not in entry or cfg.uses_standin(backbone):
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
    return dict(cls.artifacts(cls.with_defaults(cfg.method_params(experiment, method))))


def plan_run(cfg: "Resolved", experiment: str, method: str, seed: int) -> RunPlan:
    """The plan of one configured run (``method`` may name a variant)."""
    exp = cfg.experiments[experiment]
    if method not in exp["methods"]:
        raise ValueError(f"experiment {experiment!r} does not run method {method!r} at scale {cfg.scale} "
                         f"(its methods: {exp['methods']})")
    cls = method_class(cfg.base_method(method))
    params = cls.with_defaults(cfg.method_params(experiment, method))
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


def describe_plan(p: RunPlan) -> str:
    """A run's plan as YAML: who it is, every setting it trains with (after every layer), the method's params with
    the defaults it fills in (the job's params hold only what the config sets), what it reads."""
    in_effect = p.method_class.with_defaults(p.params.get("method_params") or {})
    doc = {"identity": p.identity, "params": p.params, "method_params_with_defaults": in_effect,
           "backbones": list(p.backbones), "archs": p.archs, "artifacts": p.artifacts,
           "extra_datasets": p.extra_datasets}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=110)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedcore.plan EXPERIMENT METHOD [--scale S] [--seed N]``: print the run's resolved settings."""
    ap = argparse.ArgumentParser(prog="python -m fedcore.plan", description="One run's settings after every layer of "
                                 "the config (experiment, scale, the scale's per-experiment override), as it trains.")
    ap.add_argument("experiment")
    ap.add_argument("method", help="a method or variant the experiment runs")
    ap.add_argument("--scale", default=None, help="default: config/config.yaml's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default=".", help="the checkout holding config/")
    a = ap.parse_args(argv)
    if a.seed < 0:  # the config's seeds are >= 0 (schema); a plan for another seed is no run's
        ap.error(f"--seed: {a.seed} is not a seed (an integer >= 0)")
    try:  # a config mistake is the user's to fix: its message, not a traceback
        top = read_yaml(Path(a.root) / "config" / "config.yaml")
        cfg = load_config({**top, **({"scale": a.scale} if a.scale else {}), "outputs": "all"}, a.root)
    except ConfigError as e:
        ap.error(str(e))
    if a.experiment not in cfg.experiments:
        ap.error(f"no experiment {a.experiment!r} at scale {cfg.scale}; experiments: {sorted(cfg.experiments)}")
    if a.method not in cfg.experiments[a.experiment]["methods"]:
        ap.error(f"experiment {a.experiment!r} does not run {a.method!r} at scale {cfg.scale}; it runs "
                 f"{cfg.experiments[a.experiment]['methods']}")
    print(describe_plan(plan_run(cfg, a.experiment, a.method, a.seed)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
