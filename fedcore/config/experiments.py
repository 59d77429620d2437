"""One experiment mapped onto a scale (its dataset, backbone, budget and overrides) and the checks of what its runs
can use: the partition against the dataset's facts, method params against each method's rules, input sizes,
augmentations, backbone entries."""
from __future__ import annotations

import copy
from pathlib import Path

from fedcore.config.files import ConfigError, check_name, deep_merge
from fedcore.config.resolved import Resolved, run_backbones
from fedcore.constraints import BackboneFacts, RunFacts, violations
from fedcore.data.facts import dataset_facts


def _run_facts(exp: dict, resolved: "Resolved") -> RunFacts:
    """What a run of ``exp`` is checked against, from static registries (nothing is built)."""
    from fedcore.backbones.registry import arch_info
    from fedcore.partition.spec import num_clients

    facts = dataset_facts(exp["dataset"])
    backbones = []
    for b in run_backbones(exp):
        info = arch_info(resolved.backbones[b]["arch"])
        backbones.append(BackboneFacts(b, info["arch"], int(info["depth"]), int(info["dim"])))
    return RunFacts(tuple(backbones), exp["dataset"], facts.classes, num_clients(exp["partition"], facts.domains))


def check_partition(name: str, exp: dict, files: str) -> None:
    """The partition fits the dataset (classes, samples per client) and the clients' backbones, from static facts."""
    from fedcore.partition.spec import num_clients, spec_limits

    facts = dataset_facts(exp["dataset"])
    bad = spec_limits(exp["partition"], facts, exp["dataset"])
    if bad:
        raise ConfigError(f"config error in {files}: experiment {name!r}, {bad[0]}")
    clients = num_clients(exp["partition"], facts.domains)
    if "client_backbones" in exp and len(exp["client_backbones"]) != clients:
        raise ConfigError(f"config error in {files}: experiment {name!r}, key 'client_backbones' has "
                          f"{len(exp['client_backbones'])} entries: allowed one per client (the partition has "
                          f"{clients} clients)")


def check_method_params(name: str, exp: dict, resolved: "Resolved", files: str) -> None:
    """Each run's method params keep their method's declared constraints (``param_rules``: ranges, block indices
    of every backbone of the run, limits from the dataset and partition) and pass its own ``check_params``."""
    from fedcore.methods import method_class

    facts = _run_facts(exp, resolved)
    for m in exp["methods"]:
        base = resolved.base_method(m)
        cls = method_class(base)
        params = cls.with_defaults(resolved.method_params(name, m))
        label = f"method {m!r}" if m == base else f"method {m!r} ({base})"
        bad = violations(cls.param_rules, params, facts)
        if bad:
            raise ConfigError(f"config error in {files}: experiment {name!r}, {label}, {bad[0]}")
        try:
            cls.check_params(params)  # what the rules cannot express, here rather than inside a job
            cls.check_federation(params, resolved.federation(name, m))
        except ValueError as e:
            raise ConfigError(f"config error in {files}: experiment {name!r}, {label}: {e}") from e


def check_augment(name: str, exp: dict, resolved: "Resolved", files: str) -> None:
    """``augment`` names known augmentations, and every method of the experiment trains on images (a head-only
    method's batches carry cached features, which no augmentation reaches)."""
    if "augment" not in exp:
        return
    from fedcore.engine.data import check_augment
    from fedcore.engine.roles import Method
    from fedcore.methods import method_class

    try:
        check_augment(tuple(exp["augment"]), f"experiment {name!r}, key 'augment'")
    except ValueError as e:
        raise ConfigError(f"config error in {files}: {e}") from e
    for m in exp["methods"]:
        if exp["augment"] and method_class(resolved.base_method(m)).frozen_features is not Method.frozen_features:
            raise ConfigError(f"config error in {files}: experiment {name!r}, key 'augment' = {exp['augment']}: "
                              f"method {m!r} trains on cached frozen features, which no augmentation reaches; run "
                              "it in an experiment without augment")


def check_input_size(name: str, exp: dict, resolved: "Resolved", files: str) -> None:
    """``input_size`` needs backbones that take any input size (ResNets: global pooling), and methods that feed
    them: not one that trains its own backbone, nor one that reads per-sample artifacts (computed at the
    backbone's own input size)."""
    if "input_size" not in exp:
        return
    from fedcore.backbones.registry import ANY_INPUT_SIZE, arch_info
    from fedcore.methods import method_class

    size = exp["input_size"]
    for b in run_backbones(exp):
        info = arch_info(resolved.backbones[b]["arch"])
        if info["family"] not in ANY_INPUT_SIZE:
            raise ConfigError(f"config error in {files}: experiment {name!r}, key 'input_size' = {size}: allowed "
                              f"only with backbones of the families {list(ANY_INPUT_SIZE)}; backbone {b!r} is a "
                              f"{info['family']} (its position embedding fixes its input size)")
    for m in exp["methods"]:
        cls = method_class(resolved.base_method(m))
        params = cls.with_defaults(resolved.method_params(name, m))
        own, artifacts = cls.own_backbone(params), cls.artifacts(params)
        if own is not None or artifacts:
            why = (f"trains its own backbone {own!r}" if own is not None
                   else f"reads per-sample artifacts {sorted(artifacts)} computed at the backbone's own input size")
            raise ConfigError(f"config error in {files}: experiment {name!r}, key 'input_size' = {size}: method "
                              f"{m!r} {why}; run it in an experiment without input_size")


def check_backbone_entry(name: str, entry: dict, path: Path) -> None:
    """A backbone entry names a registered arch and one of its weight tags (registry.PRETRAINED_CFGS), and its
    `pretrain:` keys are ones its objective's pretraining accepts."""
    from fedcore.backbones.pretrain import objective_keys
    from fedcore.backbones.registry import ARCH_SPECS, pretrained_cfg

    # the arch first: an unknown one would otherwise be reported as an unknown tag (its known tags: none)
    check_name(entry["arch"], ARCH_SPECS, f"{path} ({name})", "arch")
    try:
        pretrained_cfg(entry["arch"], entry.get("tag"))
    except ValueError as e:
        raise ConfigError(f"config error in {path} ({name}) at arch/tag: {e}") from e
    settings = entry.get("pretrain", {})
    objective = settings.get("objective", "supervised")
    unknown = sorted(set(settings) - {"objective"} - set(objective_keys(objective)))
    if unknown:
        raise ConfigError(f"config error in {path} ({name}) at pretrain: {unknown} are not settings of the "
                          f"{objective} objective; it takes {objective_keys(objective)}")


def resolve_experiment(name: str, exp: dict, paper: str, scale: dict, files: str, validate_spec,
                       partition_id) -> dict:
    """Map one experiment onto the scale: concrete dataset/backbone, budget, per-experiment overrides; errors name
    ``files`` (the experiment file after the scale's), where the values were written."""
    out = copy.deepcopy(exp)
    out["paper"] = paper
    out.setdefault("evaluation", {})
    out["evaluation"].setdefault("global_test", "pooled_local")
    out["federation"] = deep_merge(out["federation"], scale.get("federation", {}))
    out["evaluation"] = deep_merge(out["evaluation"], scale.get("evaluation", {}))
    out["report"] = deep_merge(out["report"], scale.get("report", {}))
    out["method_federation"] = deep_merge(out.get("method_federation", {}), scale.get("method_federation", {}))
    run = scale.get("run_federation")
    if run:  # over the experiment's budget and every method's own, so that no run keeps a longer one
        out["federation"] = deep_merge(out["federation"], run)
        out["method_federation"] = {m: deep_merge(b, run) for m, b in out["method_federation"].items()}
    if scale.get("method_params"):  # the scale's params of a method, over the experiment's own
        out["method_params"] = deep_merge(out.get("method_params", {}), scale["method_params"])
    by_scheme = scale.get("partition_by_scheme", {}).get(out["partition"]["scheme"])
    if by_scheme:
        out["partition"] = deep_merge(out["partition"], by_scheme)
    out = deep_merge(out, scale.get("experiments", {}).get(name, {}))
    out["dataset_logical"], out["dataset"] = exp["dataset"], scale["datasets"][exp["dataset"]]
    out["backbone"] = scale["backbones"][exp["backbone"]]
    if "client_backbones" in exp:
        for i, b in enumerate(exp["client_backbones"]):
            check_name(b, scale["backbones"], f"{files} (experiment {name})", f"client_backbones[{i}]")
        out["client_backbones"] = [scale["backbones"][b] for b in exp["client_backbones"]]
    missing = [k for k in ("rounds", "participation", "local_epochs", "batch_size") if k not in out["federation"]]
    if missing:
        raise ConfigError(f"config error in {files}: experiment {name}: federation is missing {missing}")
    # no silent defaults for what sets a run's numbers: the optimiser and its learning rate are the paper's to state
    missing = [k for k in ("name", "lr") if k not in out.get("optimizer", {})]
    if missing:
        raise ConfigError(f"config error in {files}: experiment {name}: optimizer is missing {missing} (no "
                          "default: write the paper's value)")
    try:
        out["partition"] = validate_spec(out["partition"])
    except ValueError as e:
        raise ConfigError(f"config error in {files}: experiment {name} at partition: {e}") from e
    out["partition_id"] = partition_id(out["partition"])
    window = out["report"]
    if window["window"] == "last" and window.get("rounds", 1) > out["federation"]["rounds"]:
        raise ConfigError(f"config error in {files}: experiment {name}: report.rounds={window['rounds']} exceeds "
                          f"federation.rounds={out['federation']['rounds']}")
    if out["evaluation"]["global_test"] == "none" and out["evaluation"].get("per_class"):
        raise ConfigError(f"config error in {files}: experiment {name}: evaluation.per_class reads the global test "
                          "set, and evaluation.global_test is none")
    every = int(out.get("evaluation", {}).get("every", 1))
    if window["window"] == "best" and every != 1:
        # the best round must be chosen among all rounds, not among the evaluated ones only
        raise ConfigError(f"config error in {files}: experiment {name}: report.window 'best' needs every round "
                          f"evaluated, but evaluation.every={every}; set evaluation: {{every: 1}}")
    for method, own in out.get("method_evaluation", {}).items():
        if window["window"] == "best" and int(own.get("every", every)) != 1:
            raise ConfigError(f"config error in {files}: experiment {name}: report.window 'best' needs every round "
                              f"evaluated, but method_evaluation.{method}.every={own['every']}")
    return out
