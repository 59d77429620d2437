"""``load_config``: the top-level config, then every paper's experiments, variants and reports at the chosen scale,
all validated before any job runs (every other scale is loaded too, so an error there also stops the run)."""
from __future__ import annotations

from pathlib import Path

from fedcore.config.experiments import (check_augment, check_backbone_entry, check_input_size, check_method_params,
                                        check_partition, resolve_experiment)
from fedcore.config.files import (CONFIG_DIR, TOP_WHERE, ConfigError, apply_defaults, check_name, check_output_dirs,
                                  deep_merge, merged, paper_file, paper_scale_chain, read_schema, read_yaml,
                                  scale_chain, validate)
from fedcore.config.reports import load_report, select_outputs
from fedcore.config.resolved import SCALE_SETTINGS, Resolved
from fedcore.papers import PAPERS


def load_config(config: dict, root: str | Path = ".") -> Resolved:
    """Validate the top-level config, then load the papers' experiments at every scale the schema lists (an
    error in any experiment file is reported whatever the chosen scale overrides); return the chosen scale's."""
    root = Path(root)
    schema = read_schema(root, list(PAPERS))
    top = apply_defaults(dict(config), schema)
    validate(top, schema, "top", TOP_WHERE)
    check_output_dirs(top)
    backbones_file = root / CONFIG_DIR / "backbones.yaml"
    backbones = read_yaml(backbones_file)
    for name, entry in backbones.items():
        validate(entry, schema, "backbone_entry", f"{backbones_file} ({name})")
        check_backbone_entry(name, entry, backbones_file)
    check_checksums(checksums_file(root))
    resolved = load_scale(top, root, schema, backbones)
    for scale in schema["$defs"]["top"]["properties"]["scale"]["enum"]:
        if scale != top["scale"]:
            resolved._scales[scale] = load_scale({**top, "scale": scale}, root, schema, backbones)
    return resolved


def checksums_file(root: Path) -> Path:
    """config/checksums.yaml: the datasets' and weights' digests (read by the data rules)."""
    return root / CONFIG_DIR / "checksums.yaml"


def check_checksums(path: Path) -> None:
    """config/checksums.yaml has the shape the data rules read (fedcore.data.registry): checked here, since otherwise
    a mistyped digest or URL is found only by a download job, at paper scale, after the download."""
    from fedcore.data.registry import ChecksumsConfigError, validate_checksums

    try:
        validate_checksums(read_yaml(path), source=str(path))
    except ChecksumsConfigError as e:
        raise ConfigError(f"config error in {e}") from e


def load_scale(top: dict, root: Path, schema: dict, backbones: dict) -> Resolved:
    """The papers' experiments, variants and reports mapped onto the scale ``top['scale']``, all checked."""
    from fedcore.methods import method_class, method_names
    from fedcore.partition.spec import partition_id, validate_spec
    from fedcore.data.registry import DATASETS

    chain = scale_chain(root, top["scale"], schema, backbones, DATASETS)
    resolved = Resolved(root=root, top=top, backbones=backbones, checksums_path=checksums_file(root),
                        scale_settings=merged({k: v for k, v in doc.items() if k in SCALE_SETTINGS}
                                              for _, doc, _ in chain), loader=load_config)
    for paper in top["papers"]:
        scale, scale_file = paper_scale_chain(chain, root, paper, schema, backbones, DATASETS)
        exp_file = paper_file(root, "experiments", paper)
        doc = read_yaml(exp_file)
        validate(doc, schema, "experiment_file", str(exp_file))
        variants = deep_merge(doc.get("variants", {}), scale.get("variants", {}))
        for vname, variant in variants.items():
            vwhere = f"{exp_file} / {scale_file} (variant {vname})"
            validate(variant, schema, "variant", vwhere)
            check_name(variant["method"], method_names(), vwhere, "method")
            if vname in method_names() or vname in resolved.variants:
                raise ConfigError(f"config error in {vwhere}: the name {vname!r} is already a method or variant")
            resolved.variants[vname] = variant
        for name, exp in doc["experiments"].items():
            if name in resolved.experiments:  # runs, tables and results are keyed by the name alone
                first = paper_file(root, "experiments", resolved.experiments[name]["paper"])
                raise ConfigError(f"config error in {exp_file} at experiments.{name}: the name is already an "
                                  f"experiment of {first}; experiment names must be unique across papers")
            where = f"{exp_file} (experiment {name})"
            check_name(exp["dataset"], scale["datasets"], where, "dataset")
            check_name(exp["backbone"], scale["backbones"], where, "backbone")
            resolved.experiments[name] = out = resolve_experiment(name, exp, doc["paper"], scale,
                                                                   f"{exp_file} after {scale_file}", validate_spec,
                                                                   partition_id)
            where = f"{where} after {scale_file}"
            runnable = set(method_names()) | set(resolved.variants)
            for i, m in enumerate(out["methods"]):
                check_name(m, runnable, where, f"methods[{i}]")
            # a known method or variant, though maybe not run here (a scale may cut an experiment's methods)
            for m in out.get("method_params", {}):
                check_name(m, runnable, where, f"method_params.{m}")
            for m in out["methods"]:
                allowed = method_class(resolved.base_method(m)).defaults
                unknown = sorted(set(resolved.method_params(name, m)) - set(allowed))
                if unknown:
                    raise ConfigError(f"config error in {where}: method {m!r} has unknown param(s) {unknown}; "
                                      f"{resolved.base_method(m)} accepts {sorted(allowed)}")
            for key in ("method_federation", "method_evaluation"):
                for m in out.get(key, {}):
                    check_name(m, runnable, where, f"{key}.{m}")
            window = out["report"]
            if window["window"] == "last":
                for m in out["methods"]:
                    rounds = resolved.federation(name, m)["rounds"]
                    if window.get("rounds", 1) > rounds:
                        raise ConfigError(f"config error in {where}: report.rounds={window['rounds']} exceeds "
                                          f"method {m!r}'s federation.rounds={rounds}")
            files = f"{exp_file} after {scale_file}"
            check_partition(name, out, files)
            check_method_params(name, out, resolved, files)
            check_input_size(name, out, resolved, files)
            check_augment(name, out, resolved, files)
        before = {kind: set(getattr(resolved, kind)) for kind in ("tables", "figures")}
        load_report(root, paper, scale, scale_file, schema, resolved)
        # a scale's overrides name this paper's experiments, tables and figures
        for name in scale.get("experiments", {}):
            check_name(name, doc["experiments"], str(scale_file), "experiments")
        for kind in ("tables", "figures"):
            for name in scale.get(kind, {}):
                check_name(name, set(getattr(resolved, kind)) - before[kind], str(scale_file), kind)
    select_outputs(resolved)
    return resolved
