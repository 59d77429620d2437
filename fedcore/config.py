"""Load, validate and resolve the pipeline configuration.

Two axes (DESIGN.md): experiments (config/experiments/<paper>.yaml, written at paper scale) and scales
(config/scales/<scale>.yaml, mapping each experiment onto concrete data, backbone and budget). Everything
is validated before any job runs; an error names the file, the key and the allowed values.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from fedcore.claim_rules import check_claim, claim_runs
from fedcore.constraints import BackboneFacts, RunFacts, violations
from fedcore.data.facts import dataset_facts
from fedcore.papers import PAPERS
from fedcore.selection import (chosen_outputs, claims_outputs, figure_experiments, figure_methods, headline_item,
                               output_runs, replace_experiment, row_source)

CONFIG_DIR = "config"
TOP_WHERE = "the top-level config (config/config.yaml or --config)"
JOB_DEFAULT = {"mem_mb": 48000}  # host memory of a job whose backbones have no `job` entry (paper scale)
TRAIN_KEYS = ("dataset", "backbone", "partition", "federation", "optimizer", "evaluation")
# scale-file keys about the scale itself, not about its experiments
SCALE_SETTINGS = ("missing_weights", "job", "keep_run_state", "results")


class ConfigError(ValueError):
    """A configuration problem, reported before any work is done."""


# libyaml's loader where PyYAML was built with it: the config files parse ~10x faster (every Snakemake start,
# and every cluster job, loads all of them at both scales)
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_CACHE: dict[tuple[str, int, int], Any] = {}  # (path, mtime_ns, size) -> parsed document


def read_yaml(path: Path) -> dict:
    """A YAML mapping (a fresh copy), with a clear error for a missing or malformed file."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _YAML_CACHE:
        try:
            _YAML_CACHE[key] = yaml.load(path.read_text(), Loader=_YAML_LOADER)  # noqa: S506 - a safe loader
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    data = _YAML_CACHE[key]
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return copy.deepcopy(data)


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` updated recursively by ``override`` (neither is modified)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _schema(root: Path) -> dict:
    """The JSON schema document, with the enum the code's registry owns filled in: the papers (fedcore/papers.py)."""
    doc = read_yaml(root / CONFIG_DIR / "schema.yaml")
    doc["$defs"]["top"]["properties"]["papers"]["items"]["enum"] = list(PAPERS)
    return doc


def _format_path(path) -> str:
    """'a.b[2].c' from a jsonschema error path."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<top level>"


def _allowed_hint(error: jsonschema.ValidationError) -> str:
    """The allowed values or keys for an error, when the schema says."""
    if error.validator == "enum":
        return f"; allowed values: {error.validator_value}"
    if error.validator == "additionalProperties" and "properties" in error.schema:
        return f"; allowed keys: {sorted(error.schema['properties'])}"
    return ""


def validate(instance: Any, schema_doc: dict, definition: str, where: str) -> None:
    """Validate ``instance`` against ``$defs/definition``; raise ConfigError naming the key and allowed values."""
    schema = {"$ref": f"#/$defs/{definition}", "$defs": schema_doc["$defs"]}
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        raise ConfigError(f"config error in {where} at {_format_path(e.absolute_path)}: {e.message}{_allowed_hint(e)}")


def _check_name(value: str, allowed, where: str, key: str) -> None:
    """A name must be one of the allowed ones."""
    if value not in allowed:
        raise ConfigError(f"config error in {where} at {key}: {value!r} is not one of {sorted(allowed)}")


def _as_yaml_scalars(value: Any) -> Any:
    """Strings inside lists and mappings read as YAML reads them ('-1' -> -1, '0.5' -> 0.5, 'true' -> True)."""
    if isinstance(value, list):
        return [_as_yaml_scalars(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_yaml_scalars(v) for k, v in value.items()}
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return parsed if isinstance(parsed, (bool, int, float)) else value
    return value


def apply_defaults(config: dict, schema: dict) -> dict:
    """The top-level config with the schema's defaults (the one place they are written) filled in and command-line
    values typed as in a config file."""
    defaults = {k: v["default"] for k, v in schema["$defs"]["top"]["properties"].items() if "default" in v}
    # Snakemake parses `--config seeds=[0,-1]` with YAML's BaseLoader, so every scalar in a list reaches us as
    # a string (['0', '-1']); read them as a config file's YAML would, so both spellings get the same checks
    # and messages ("-1 is less than the minimum of 0", not "'-1' is not of type 'integer'").
    out = {**defaults, **{k: _as_yaml_scalars(v) if isinstance(v, (list, dict)) else v for k, v in config.items()}}
    if isinstance(out.get("seeds"), (int, str)):  # `seeds=0` reaches us as 0: one seed
        out["seeds"] = [out["seeds"]]
    return out


def _check_output_dirs(top: dict) -> None:
    """``results`` and ``resources`` are directories, or do not exist yet (relative to Snakemake's working
    directory, where the pipeline writes them)."""
    for key in ("results", "resources"):
        path = Path(str(top[key]))
        for p in (path, *path.parents):
            if p.exists():
                if not p.is_dir():
                    raise ConfigError(f"config error in {TOP_WHERE} at {key}: {top[key]!r} must be a directory "
                                      f"(created if missing), but {str(p)!r} is a file")
                break


@dataclass
class Resolved:
    """The validated configuration with every experiment mapped onto the chosen scale."""

    root: Path
    top: dict
    experiments: dict[str, dict] = field(default_factory=dict)
    tables: dict[str, dict] = field(default_factory=dict)
    figures: dict[str, dict] = field(default_factory=dict)
    variants: dict[str, dict] = field(default_factory=dict)   # name -> {method, params, label}
    # paper -> {"tables": [names], "figures": [names], "claims": [claim dicts]} of config/reports/<paper>.yaml
    reports: dict[str, dict] = field(default_factory=dict)
    backbones: dict[str, dict] = field(default_factory=dict)
    checksums_path: Path | None = None
    # the scale's own settings (SCALE_SETTINGS of config/scales/<scale>.yaml and its base scales): missing_weights, job,
    # keep_run_state, results
    scale_settings: dict[str, Any] = field(default_factory=dict)
    # the tables and figures the config's `outputs` picks (fedcore/selection.py), and the configured runs they
    # read; None: every configured run (`outputs: all`)
    outputs: list[str] = field(default_factory=list)
    selected: set[tuple[str, str]] | None = None
    _scales: dict[str, "Resolved"] = field(default_factory=dict, repr=False, compare=False)  # at_scale's cache
    # run_resources' cache: the rule asks three times per job (gpu, runtime, mem_mb)
    _requests: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def scale(self) -> str:
        """mini | paper | smoke."""
        return self.top["scale"]

    @property
    def seeds(self) -> list[int]:
        """Seeds to run."""
        return list(self.top["seeds"])

    def runs(self, selected_only: bool = True) -> list[dict[str, Any]]:
        """One dict per training run: experiment, method, seed; the runs the chosen outputs read unless
        ``selected_only`` is false (then every configured run)."""
        return [{"experiment": e, "method": m, "seed": s}
                for e, exp in self.experiments.items() for m in exp["methods"] for s in self.seeds
                if not selected_only or self.is_selected(e, m)]

    def is_selected(self, experiment: str, method: str) -> bool:
        """Whether a configured run is among those the chosen outputs read (always, with ``outputs: all``)."""
        return self.selected is None or (experiment, method) in self.selected

    def datasets(self) -> list[str]:
        """Concrete datasets needed by the runs: each experiment's, and those a method reads besides (FedMD's
        public data)."""
        from fedcore.methods import method_class

        out = {exp["dataset"] for exp in self.experiments.values()}
        for r in self.runs():
            cls = method_class(self.base_method(r["method"]))
            out |= set(cls.extra_datasets({**cls.defaults, **self.method_params(r["experiment"], r["method"])}).values())
        return sorted(out)

    def backbones_needed(self) -> list[str]:
        """Concrete backbones needed by the experiments."""
        return sorted({b for exp in self.experiments.values() for b in run_backbones(exp)})

    def partitions(self, run_only: bool = False) -> dict[tuple[str, str], dict]:
        """(dataset, partition id) -> validated partition spec; ``run_only``: only of experiments with runs at this
        scale (a scale may run none of an experiment's methods) among the chosen outputs' runs."""
        return {(exp["dataset"], exp["partition_id"]): exp["partition"] for e, exp in self.experiments.items()
                if not run_only or any(self.is_selected(e, m) for m in exp["methods"])}

    def base_method(self, method: str) -> str:
        """The registered method a run's method name executes (itself, or the variant's method)."""
        return self.variants[method]["method"] if method in self.variants else method

    def method_params(self, experiment: str, method: str) -> dict[str, Any]:
        """A run's method params: the experiment's for the base method, then the variant's, then the
        experiment's for the variant name (so a scale can adapt one variant in one experiment)."""
        given = self.experiments[experiment].get("method_params", {})
        base = self.base_method(method)
        out = copy.deepcopy(given.get(base, {}))
        if method in self.variants:
            out = deep_merge(out, self.variants[method].get("params", {}))
            out = deep_merge(out, given.get(method, {}))
        return out

    def federation(self, experiment: str, method: str) -> dict[str, Any]:
        """A run's federation: the experiment's, then the method's own budget (a variant's, else its method's)."""
        exp = self.experiments[experiment]
        own = exp.get("method_federation", {})
        budget = own.get(method, own.get(self.base_method(method), {}))
        return deep_merge(exp["federation"], budget)

    def train_params(self, experiment: str, method: str) -> dict[str, Any]:
        """Only what one run depends on, so editing another experiment or method reruns nothing here."""
        exp = self.experiments[experiment]
        out = {k: copy.deepcopy(exp[k]) for k in TRAIN_KEYS}
        out["federation"] = self.federation(experiment, method)
        out["method"] = self.base_method(method)
        out["method_params"] = self.method_params(experiment, method)
        if "client_backbones" in exp:  # which of the run's backbones each client uses (homogeneous runs: absent)
            names = run_backbones(exp)
            out["client_backbones"] = [names.index(b) for b in exp["client_backbones"]]
        if "input_size" in exp:  # absent unless set, so that the other runs' params stay as they were
            out["input_size"] = exp["input_size"]
        if "augment" in exp:  # the same: an experiment without a base augmentation keeps its runs' params
            out["augment"] = list(exp["augment"])
        out["final_window"] = exp["report"].get("rounds", 1) if exp["report"]["window"] == "last" else 1
        out["paper"] = exp["paper"]
        return out

    def run_resources(self, experiment: str, method: str) -> dict[str, int]:
        """A training job's cluster request: the scale's ``job`` where it has one (mini: one CPU's worth; smoke: no GPU
        slot), else gpu, mem_mb (the run's backbones' ``job`` entries, the largest ask) and runtime (minutes:
        fedcore/estimate.py's estimate of the run on one GPU times its margin, computed once per run)."""
        if "job" in self.scale_settings:
            return dict(self.scale_settings["job"])
        key = (experiment, method)
        if key not in self._requests:
            from fedcore.estimate import estimate_run, request_minutes

            jobs = [self.backbones[b].get("job", {}) for b in run_backbones(self.experiments[experiment])]
            mem = max([j.get("mem_mb", JOB_DEFAULT["mem_mb"]) for j in jobs])
            self._requests[key] = {"gpu": 1, "mem_mb": int(mem),
                                   "runtime": request_minutes(estimate_run(self, experiment, method))}
        return dict(self._requests[key])

    @property
    def keep_run_state(self) -> bool:
        """Whether a run's final.pt stays after the jobs that read it and the run keeps its checkpoint.pt (every
        scale but smoke)."""
        return bool(self.scale_settings.get("keep_run_state", True))

    def uses_standin(self, backbone: str) -> bool:
        """Whether ``backbone`` reads a random stand-in (fedcore/backbones/standin.py) at this scale: it names a
        ``weights:`` file, the file is not under the resources dir, and the scale says ``missing_weights: random``
        (smoke; at any other scale a missing file stays an error)."""
        entry = self.backbones[backbone]
        if self.scale_settings.get("missing_weights", "error") != "random" or "weights" not in entry:
            return False
        return not (Path(str(self.top["resources"])) / "weights" / entry["weights"]).is_file()

    def implemented_methods(self) -> list[str]:
        """Methods whose module exists, plus the variants of those methods (tables say 'not implemented' otherwise)."""
        from fedcore.methods import method_names

        have = set(method_names())
        return sorted(have | {v for v, x in self.variants.items() if x["method"] in have})

    def at_scale(self, scale: str) -> "Resolved":
        """The same configuration resolved at another scale (loaded once, then cached)."""
        if scale == self.scale:
            return self
        if scale not in self._scales:
            self._scales[scale] = load_config({**self.top, "scale": scale}, self.root)
        return self._scales[scale]

    def param_count_models(self, table: str) -> list[dict[str, Any]]:
        """Table 5's model specs, one per column; a method's model gets its paper-scale params and backbone
        arch (the paper's architectures are counted at every scale: nothing is trained or read)."""
        out = []
        for col in self.tables[table]["columns"]:
            model = copy.deepcopy(col["model"])
            if model["source"] == "method":
                try:
                    paper = self.at_scale("paper")
                except ConfigError as e:
                    raise ConfigError(f"table {table} counts {model['method']} with its paper-scale params, "
                                      f"but the paper-scale config does not load: {e}") from e
                exp = paper.experiments[model["experiment"]]
                model["base"] = paper.base_method(model["method"])
                model["params"] = paper.method_params(model["experiment"], model["method"])
                model.setdefault("arch", paper.backbones[exp["backbone"]]["arch"])
                if "input_size" in exp:  # FedHPL (CNN)'s pad prompt is sized by the images it pads
                    model["input_size"] = exp["input_size"]
            out.append(model)
        return out

    def claims_view(self, paper: str) -> dict[str, dict]:
        """Per scale, what a paper's claims and scorecard are built with: its tables and figures at that scale,
        the experiments' report view and the implemented methods. This scale, and the other scales whose numbers are
        results (not smoke's: ``results: false``)."""
        out = {}
        others = {s for s, at in self._scales.items() if at.scale_settings.get("results", True)}
        for scale in sorted({self.scale, *others}):
            at = self.at_scale(scale)
            names = at.reports.get(paper, {"tables": [], "figures": []})
            out[scale] = {"tables": {n: at.tables[n] for n in names["tables"]},
                          "figures": {n: at.figures[n] for n in names["figures"]},
                          "experiments": at.report_view(), "implemented": at.implemented_methods()}
        return out

    def report_view(self) -> dict[str, dict]:
        """Experiments as the report step needs them (methods and report window)."""
        return {e: {"methods": list(x["methods"]), "report": dict(x["report"]), "paper": x["paper"],
                    "dataset": x["dataset"], "rounds": x["federation"]["rounds"],
                    # a method's own budget where it differs (zs_clip: one round), so its runs are not "incomplete"
                    "method_rounds": {m: self.federation(e, m)["rounds"] for m in x["methods"]
                                      if self.federation(e, m)["rounds"] != x["federation"]["rounds"]},
                    # configured here but not read by the chosen outputs, so not run (cells say "not selected")
                    "not_selected": [m for m in x["methods"] if not self.is_selected(e, m)]}
                for e, x in self.experiments.items()}


def run_backbones(exp: dict) -> list[str]:
    """The concrete backbones a run of ``exp`` loads: its ``client_backbones`` in first-use order, else ``backbone``."""
    return list(dict.fromkeys(exp["client_backbones"])) if "client_backbones" in exp else [exp["backbone"]]


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


def _check_partition(name: str, exp: dict, files: str) -> None:
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


def _check_method_params(name: str, exp: dict, resolved: "Resolved", files: str) -> None:
    """Each run's method params keep their method's declared constraints (``param_rules``: ranges, block indices
    of every backbone of the run, limits from the dataset and partition) and pass its own ``check_params``."""
    from fedcore.methods import method_class

    facts = _run_facts(exp, resolved)
    for m in exp["methods"]:
        base = resolved.base_method(m)
        cls = method_class(base)
        params = {**cls.defaults, **resolved.method_params(name, m)}
        label = f"method {m!r}" if m == base else f"method {m!r} ({base})"
        bad = violations(cls.param_rules, params, facts)
        if bad:
            raise ConfigError(f"config error in {files}: experiment {name!r}, {label}, {bad[0]}")
        try:
            cls.check_params(params)  # what the rules cannot express, here rather than inside a job
            cls.check_federation(params, resolved.federation(name, m))
        except ValueError as e:
            raise ConfigError(f"config error in {files}: experiment {name!r}, {label}: {e}") from e


def _check_augment(name: str, exp: dict, resolved: "Resolved", files: str) -> None:
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


def _check_input_size(name: str, exp: dict, resolved: "Resolved", files: str) -> None:
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
        params = {**cls.defaults, **resolved.method_params(name, m)}
        own, artifacts = cls.own_backbone(params), cls.artifacts(params)
        if own is not None or artifacts:
            why = (f"trains its own backbone {own!r}" if own is not None
                   else f"reads per-sample artifacts {sorted(artifacts)} computed at the backbone's own input size")
            raise ConfigError(f"config error in {files}: experiment {name!r}, key 'input_size' = {size}: method "
                              f"{m!r} {why}; run it in an experiment without input_size")


def load_config(config: dict, root: str | Path = ".") -> Resolved:
    """Validate the top-level config, then load the papers' experiments at every scale the schema lists (an
    error in any experiment file is reported whatever the chosen scale overrides); return the chosen scale's."""
    root = Path(root)
    schema = _schema(root)
    top = apply_defaults(dict(config), schema)
    validate(top, schema, "top", TOP_WHERE)
    _check_output_dirs(top)
    backbones_file = root / CONFIG_DIR / "backbones.yaml"
    backbones = read_yaml(backbones_file)
    for name, entry in backbones.items():
        validate(entry, schema, "backbone_entry", f"{backbones_file} ({name})")
        _check_backbone_entry(name, entry, backbones_file)
    resolved = _load_scale(top, root, schema, backbones)
    for scale in schema["$defs"]["top"]["properties"]["scale"]["enum"]:
        if scale != top["scale"]:
            resolved._scales[scale] = _load_scale({**top, "scale": scale}, root, schema, backbones)
    return resolved


def _check_backbone_entry(name: str, entry: dict, path: Path) -> None:
    """A backbone entry names a registered arch and one of its weight tags (registry.PRETRAINED_CFGS), and its
    `pretrain:` keys are ones its objective's pretraining accepts."""
    from fedcore.backbones.pretrain import objective_keys
    from fedcore.backbones.registry import pretrained_cfg

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


def _load_scale(top: dict, root: Path, schema: dict, backbones: dict) -> Resolved:
    """The papers' experiments, variants and reports mapped onto the scale ``top['scale']``, all checked."""
    from fedcore.methods import method_class, method_names
    from fedcore.partition.spec import partition_id, validate_spec
    from fedcore.data.registry import DATASETS

    chain = _scale_chain(root, top["scale"], schema, backbones, DATASETS)
    resolved = Resolved(root=root, top=top, backbones=backbones, checksums_path=root / CONFIG_DIR / "checksums.yaml",
                        scale_settings=_merged({k: v for k, v in doc.items() if k in SCALE_SETTINGS}
                                               for _, doc, _ in chain))
    for paper in top["papers"]:
        scale, scale_file = _paper_scale_chain(chain, root, paper, schema, backbones, DATASETS)
        exp_file = root / CONFIG_DIR / "experiments" / f"{paper}.yaml"
        doc = read_yaml(exp_file)
        validate(doc, schema, "experiment_file", str(exp_file))
        variants = deep_merge(doc.get("variants", {}), scale.get("variants", {}))
        for vname, variant in variants.items():
            vwhere = f"{exp_file} / {scale_file} (variant {vname})"
            validate(variant, schema, "variant", vwhere)
            _check_name(variant["method"], method_names(), vwhere, "method")
            if vname in method_names() or vname in resolved.variants:
                raise ConfigError(f"config error in {vwhere}: the name {vname!r} is already a method or variant")
            resolved.variants[vname] = variant
        for name, exp in doc["experiments"].items():
            if name in resolved.experiments:
                raise ConfigError(f"experiment {name!r} in {exp_file} is defined twice")
            where = f"{exp_file} (experiment {name})"
            _check_name(exp["dataset"], scale["datasets"], where, "dataset")
            _check_name(exp["backbone"], scale["backbones"], where, "backbone")
            resolved.experiments[name] = out = _resolve_experiment(name, exp, doc["paper"], scale, scale_file,
                                                                   validate_spec, partition_id)
            where = f"{where} after {scale_file}"
            runnable = set(method_names()) | set(resolved.variants)
            for i, m in enumerate(out["methods"]):
                _check_name(m, runnable, where, f"methods[{i}]")
            # a known method or variant, though maybe not run here (a scale may cut an experiment's methods)
            for m in out.get("method_params", {}):
                _check_name(m, runnable, where, f"method_params.{m}")
            for m in out["methods"]:
                allowed = method_class(resolved.base_method(m)).defaults
                unknown = sorted(set(resolved.method_params(name, m)) - set(allowed))
                if unknown:
                    raise ConfigError(f"config error in {where}: method {m!r} has unknown param(s) {unknown}; "
                                      f"{resolved.base_method(m)} accepts {sorted(allowed)}")
            for m in out.get("method_federation", {}):
                _check_name(m, runnable, where, f"method_federation.{m}")
            window = out["report"]
            if window["window"] == "last":
                for m in out["methods"]:
                    rounds = resolved.federation(name, m)["rounds"]
                    if window.get("rounds", 1) > rounds:
                        raise ConfigError(f"config error in {where}: report.rounds={window['rounds']} exceeds "
                                          f"method {m!r}'s federation.rounds={rounds}")
            files = f"{exp_file} after {scale_file}"
            _check_partition(name, out, files)
            _check_method_params(name, out, resolved, files)
            _check_input_size(name, out, resolved, files)
            _check_augment(name, out, resolved, files)
        before = {kind: set(getattr(resolved, kind)) for kind in ("tables", "figures")}
        _load_report(root, paper, scale, scale_file, schema, resolved)
        # a scale's overrides name this paper's experiments, tables and figures
        for name in scale.get("experiments", {}):
            _check_name(name, doc["experiments"], str(scale_file), "experiments")
        for kind in ("tables", "figures"):
            for name in scale.get(kind, {}):
                _check_name(name, set(getattr(resolved, kind)) - before[kind], str(scale_file), kind)
    _select_outputs(resolved)
    return resolved


def _select_outputs(resolved: Resolved) -> None:
    """Pick the outputs the config's ``outputs`` names and the configured runs they read (fedcore/selection.py)."""
    outputs = resolved.top["outputs"]
    headline = {p: r["headline"] for p, r in resolved.reports.items()}
    if outputs == "headline":  # a paper without a list would silently build nothing
        bare = [p for p in resolved.top["papers"] if not headline.get(p)]
        if bare:
            raise ConfigError(f"config error in {TOP_WHERE} at outputs: 'headline' builds each paper's headline: "
                              f"list, but config/reports/<paper>.yaml of {bare} has none (add one, or use "
                              "outputs=all or a list of names)")
    if outputs == "claims":  # every loaded paper's claims: exactly the runs their verdicts need
        _select_claim_runs(resolved)
        return
    try:
        chosen = chosen_outputs(outputs, headline, resolved.tables, resolved.figures)
    except ValueError as e:
        raise ConfigError(f"config error in {TOP_WHERE} at outputs: {e}") from e
    resolved.outputs = list(chosen)
    if outputs == "all":
        resolved.selected = None
        return
    resolved.selected = set().union(*[output_runs(n, resolved.tables, resolved.figures, resolved.experiments, part)
                                      for n, parts in chosen.items() for part in parts])


def _select_claim_runs(resolved: Resolved) -> None:
    """``outputs: claims``: the tables and figures the loaded papers' claims read, and only the runs whose cells
    the claims' verdicts need (fedcore/claim_rules.py claim_runs)."""
    claims = {p: r.get("claims", []) for p, r in resolved.reports.items() if p in resolved.top["papers"]}
    resolved.outputs = list(claims_outputs(claims))
    resolved.selected = set().union(*[claim_runs(c, resolved.tables, resolved.figures, resolved.experiments)
                                      for items in claims.values() for c in items])


def _check_mappings(scale: dict, scale_file: Path, backbones: dict, datasets) -> None:
    """A scale's dataset and backbone mappings name concrete datasets and configured backbones."""
    for logical, concrete in scale.get("datasets", {}).items():
        _check_name(concrete, datasets, str(scale_file), f"datasets.{logical}")
    for logical, concrete in scale.get("backbones", {}).items():
        _check_name(concrete, backbones, str(scale_file), f"backbones.{logical}")


def _paper_scale(common: dict, common_file: Path, root: Path, scale: str, paper: str, schema: dict,
                 backbones: dict, datasets) -> tuple[dict, Path]:
    """The scale as one paper sees it: config/scales/<scale>/<paper>.yaml (if any) merged over the scale file;
    and the file that error messages name (the paper's own when it has one)."""
    path = root / CONFIG_DIR / "scales" / scale / f"{paper}.yaml"
    if not path.exists():
        return common, common_file
    overlay = read_yaml(path)
    validate(overlay, schema, "paper_scale_file", str(path))
    _check_mappings(overlay, path, backbones, datasets)
    return deep_merge(common, overlay), path


def _scale_chain(root: Path, scale: str, schema: dict, backbones: dict, datasets) -> list[tuple[str, dict, Path]]:
    """The scale files from the first ``base`` down to ``scale``'s own: (name, document without ``base``, path),
    each validated and its mappings checked."""
    chain: list[tuple[str, dict, Path]] = []
    name: str | None = scale
    while name is not None:
        path = root / CONFIG_DIR / "scales" / f"{name}.yaml"
        if chain:
            below = chain[-1][2]
            if name in [n for n, _, _ in chain]:
                raise ConfigError(f"config error in {below} at base: {name!r} starts a cycle of scales "
                                  f"({' -> '.join([n for n, _, _ in chain] + [name])})")
            if not path.exists():
                raise ConfigError(f"config error in {below} at base: {name!r} is not a scale ({path} does not exist)")
        doc = read_yaml(path)
        validate(doc, schema, "scale_file", str(path))
        _check_mappings(doc, path, backbones, datasets)
        base = doc.pop("base", None)
        chain.append((name, doc, path))
        name = base
    return chain[::-1]


def _merged(docs) -> dict:
    """The documents deep-merged in order (later ones win)."""
    out: dict = {}
    for doc in docs:
        out = deep_merge(out, doc)
    return out


def _paper_scale_chain(chain: list[tuple[str, dict, Path]], root: Path, paper: str, schema: dict, backbones: dict,
                       datasets) -> tuple[dict, str]:
    """The scale as one paper sees it: for each scale of the chain (base first), its file and then its
    <scale>/<paper>.yaml, deep-merged in that order; and the file that error messages name (the top scale's paper
    file, else its scale file), with the base scale it extends."""
    layers, where = [], ""
    for name, doc, path in chain:
        layer, where = _paper_scale(doc, path, root, name, paper, schema, backbones, datasets)
        layers.append(layer)
    scale = _merged(layers)
    missing = [k for k in ("datasets", "backbones") if k not in scale]
    if missing:
        raise ConfigError(f"config error in {chain[-1][2]}: {missing} are required (in it or in its base scale)")
    label = str(where) if len(chain) == 1 else f"{where} (over scale {' over '.join(n for n, _, _ in chain[-2::-1])})"
    return scale, label


def _resolve_experiment(name: str, exp: dict, paper: str, scale: dict, scale_file: Path,
                        validate_spec, partition_id) -> dict:
    """Map one experiment onto the scale: concrete dataset/backbone, budget, per-experiment overrides."""
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
            _check_name(b, scale["backbones"], f"experiment {name}", f"client_backbones[{i}]")
        out["client_backbones"] = [scale["backbones"][b] for b in exp["client_backbones"]]
    missing = [k for k in ("rounds", "participation", "local_epochs", "batch_size") if k not in out["federation"]]
    if missing:
        raise ConfigError(f"experiment {name}: federation is missing {missing} after applying {scale_file}")
    # no silent defaults for what sets a run's numbers: the optimiser and its learning rate are the paper's to state
    missing = [k for k in ("name", "lr") if k not in out.get("optimizer", {})]
    if missing:
        raise ConfigError(f"experiment {name}: optimizer is missing {missing} after applying {scale_file} (no "
                          "default: write the paper's value)")
    try:
        out["partition"] = validate_spec(out["partition"])
    except ValueError as e:
        raise ConfigError(f"config error in experiment {name} at partition: {e}") from e
    out["partition_id"] = partition_id(out["partition"])
    window = out["report"]
    if window["window"] == "last" and window.get("rounds", 1) > out["federation"]["rounds"]:
        raise ConfigError(f"experiment {name}: report.rounds={window['rounds']} exceeds federation.rounds="
                          f"{out['federation']['rounds']}")
    return out


def _load_report(root: Path, paper: str, scale: dict, scale_file: Path, schema: dict, resolved: Resolved) -> None:
    """Read config/reports/<paper>.yaml, apply the scale's report overrides, validate, fill display labels."""
    report_file = root / CONFIG_DIR / "reports" / f"{paper}.yaml"
    if not report_file.exists():
        return
    report = read_yaml(report_file)
    validate(report, schema, "report_file", str(report_file))
    runnable = _runnable(resolved)
    labels = {**{v: x["label"] for v, x in resolved.variants.items() if "label" in x}, **report.get("labels", {})}
    for kind, definition in (("tables", "table"), ("figures", "figure")):
        for name, entry in report.get(kind, {}).items():
            if name in getattr(resolved, kind):
                raise ConfigError(f"{kind[:-1]} {name!r} in {report_file} is defined twice")
            where = f"{report_file} ({kind[:-1]} {name})"
            override = scale.get(kind, {}).get(name)
            if override is not None:
                entry = deep_merge(entry, override)
                where = f"{where} after {scale_file}"
            validate(entry, schema, definition, where)
            if entry.get("kind") in ("dataset_stats", "image_grid"):  # data-only: the scale's dataset of each item
                items = entry["rows"] if entry["kind"] == "dataset_stats" else entry["panels"]
                entry["concrete"] = {x["dataset"]: scale["datasets"].get(x["dataset"]) for x in items}
            if kind == "tables":
                _check_table(entry, resolved.experiments, where, runnable)
                if entry.get("kind", "metrics") in ("metrics", "linear_probe"):
                    # explicit row_labels win; then the report's labels; then the variants' own labels
                    entry["row_labels"] = {r: entry.get("row_labels", {}).get(r, labels.get(r, r)) for r in entry["rows"]}
            else:
                _check_figure(entry, resolved.experiments, where, runnable)
                entry["labels"] = {m: labels.get(m, m) for m in sorted(figure_methods(entry, resolved.experiments))}
            entry["source_paper"] = paper  # its section of the HTML report (entry["paper"]: the paper's numbers)
            if kind == "tables" and entry.get("kind", "metrics") == "metrics":
                for key in ("reported_round", "identical_rows"):  # the paper's, for the table's notes
                    if key in report:
                        entry[key] = report[key]
            getattr(resolved, kind)[name] = entry
    tables = {n: resolved.tables[n] for n in report.get("tables", {})}
    figures = {n: resolved.figures[n] for n in report.get("figures", {})}
    _check_claims(report.get("claims", []), tables, figures, f"{report_file} (claims) after {scale_file}")
    _check_headline(report.get("headline", []), tables, figures, str(report_file))
    resolved.reports[paper] = {"tables": list(tables), "figures": list(figures), "claims": report.get("claims", []),
                               "headline": list(report.get("headline", []))}


def _check_headline(items: list, tables: dict, figures: dict, where: str) -> None:
    """Headline entries name this paper's tables or figures; a part (rows, columns) only of a table, by its row
    keys and column labels or positions."""
    for i, item in enumerate(items):
        name, part = headline_item(item)
        _check_name(name, [*tables, *figures], where, f"headline[{i}]")
        if not part:
            continue
        if name not in tables:
            raise ConfigError(f"config error in {where} at headline[{i}]: rows/columns select part of a table; "
                              f"{name!r} is a figure")
        for row in part.get("rows", []):
            _check_name(row, tables[name]["rows"], where, f"headline[{i}].rows")
        labels = [c["label"] for c in tables[name]["columns"]]
        for col in part.get("columns", []):
            if col not in labels and not (isinstance(col, int) and 0 <= col < len(labels)):
                raise ConfigError(f"config error in {where} at headline[{i}].columns: {col!r} is neither a column "
                                  f"label of {name} ({labels}) nor a position 0..{len(labels) - 1}")


def _check_claims(claims: list[dict], tables: dict, figures: dict, where: str) -> None:
    """Claims have unique ids and name tables, rows and columns of this paper that their predicate can read."""
    seen = set()
    for i, claim in enumerate(claims):
        if claim["id"] in seen:
            raise ConfigError(f"config error in {where} at claims[{i}].id: {claim['id']!r} is used twice")
        seen.add(claim["id"])
        try:
            check_claim(claim, tables, figures)
        except ValueError as e:
            raise ConfigError(f"config error in {where} at claims[{i}] ({claim['id']}): {e}") from e


def _runnable(resolved: Resolved) -> set[str]:
    """Names a run's method may take: registered methods and the loaded variants."""
    from fedcore.methods import method_names

    return set(method_names()) | set(resolved.variants)


def _check_figure(fig: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """A figure names known experiments and known methods/variants, and each setting at most once per series."""
    for j, series in enumerate(fig.get("series", [])):
        for k, point in enumerate(series["points"]):
            if "experiment" in point:
                _check_name(point["experiment"], experiments, where, f"series[{j}].points[{k}].experiment")
    for j, line in enumerate(fig.get("lines", [])):
        for panel in fig["panels"]:
            _check_name(replace_experiment(panel["experiment"], line.get("experiment_replace")), experiments, where,
                        f"lines[{j}].experiment_replace (panel {panel['label']!r})")
    for i, e in enumerate(figure_experiments(fig)):
        _check_name(e, experiments, where, f"experiments[{i}]" if "experiments" in fig else "experiment")
    for m in sorted(figure_methods(fig)):
        _check_name(m, runnable, where, "methods")
    if fig["kind"] == "partition_bubbles":
        datasets = {experiments[p["experiment"]]["dataset"] for p in fig["panels"]}
        if len(datasets) != 1:
            raise ConfigError(f"config error in {where} at panels: the panels' experiments must share one dataset "
                              f"(the bubbles' domains and classes), got {sorted(datasets)}")
    for j, series in enumerate(fig.get("series", [])):
        values = [p["value"] for p in series["points"]]
        if len(set(values)) != len(values):
            raise ConfigError(f"config error in {where} at series[{j}].points: a setting appears twice in {values}")


def _check_table(table: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """Rows are methods or variants; columns name known experiments; paper rows have one value per column."""
    if table.get("kind") == "param_count":
        _check_param_table(table, experiments, where, runnable)
        return
    if table.get("kind") == "dataset_stats":  # reads bundles only; its rows name datasets, not methods
        return
    if table.get("kind") == "linear_probe":
        _check_probe_table(table, experiments, where, runnable)
        return
    sources = table.get("row_sources", {})
    for row, src in sources.items():
        _check_name(row, table["rows"], where, f"row_sources.{row}")
        if "method" in src:
            _check_name(src["method"], runnable, where, f"row_sources.{row}.method")
        if "experiment" in src:
            _check_name(src["experiment"], experiments, where, f"row_sources.{row}.experiment")
    every_column_names_a_method = all("method" in col for col in table["columns"])
    for i, row in enumerate(table["rows"]):
        if "method" not in sources.get(row, {}) and not every_column_names_a_method:
            _check_name(row, runnable, where, f"rows[{i}]")
    for i, col in enumerate(table["columns"]):
        _check_name(col["experiment"], experiments, where, f"columns[{i}].experiment")
        if "method" in col:
            _check_name(col["method"], runnable, where, f"columns[{i}].method")
        for row in sources:
            _check_name(row_source(table, row, col)[1]["experiment"], experiments, where,
                        f"row_sources.{row} (column {i})")
        if col["metric"] == "client_acc" and ("client" in col) == ("clients" in col):
            raise ConfigError(f"config error in {where} at columns[{i}]: metric client_acc needs a 'client' key or "
                              "a 'clients' list, not both")
        if "clients" in col and col["metric"] != "client_acc":
            raise ConfigError(f"config error in {where} at columns[{i}]: 'clients' goes with metric client_acc, "
                              f"not {col['metric']!r}")
    _check_paper_rows(table, where)
    attrs = table.get("row_attributes")
    if attrs:
        for row, values in attrs["values"].items():
            _check_name(row, table["rows"], where, f"row_attributes.values.{row}")
            if len(values) != len(attrs["columns"]):
                raise ConfigError(f"config error in {where} at row_attributes.values.{row}: {len(values)} values "
                                  f"for {len(attrs['columns'])} columns")


def _check_paper_rows(table: dict, where: str) -> None:
    """The paper's numbers (and stds) name table rows and give one value per column."""
    for key in ("paper", "paper_std"):
        for row, values in table.get(key, {}).items():
            _check_name(row, table["rows"], where, f"{key}.{row}")
            if len(values) != len(table["columns"]):
                raise ConfigError(f"config error in {where} at {key}.{row}: {len(values)} values for "
                                  f"{len(table['columns'])} columns")


def _check_probe_table(table: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """Rows are methods or read one through ``row_sources``; columns name known experiments; paper rows fit."""
    sources = table.get("row_sources", {})
    for row, src in sources.items():
        _check_name(row, table["rows"], where, f"row_sources.{row}")
        _check_name(src["method"], runnable, where, f"row_sources.{row}.method")
    for i, row in enumerate(table["rows"]):
        if row not in sources:
            _check_name(row, runnable, where, f"rows[{i}]")
    for i, col in enumerate(table["columns"]):
        _check_name(col["experiment"], experiments, where, f"columns[{i}].experiment")
    _check_paper_rows(table, where)


def _check_param_table(table: dict, experiments: dict, where: str, runnable: set[str]) -> None:
    """A model built from a method names a known experiment and method; others name an architecture."""
    for i, col in enumerate(table["columns"]):
        model = col["model"]
        if model["source"] == "method":
            for key in ("method", "experiment"):
                if key not in model:
                    raise ConfigError(f"config error in {where} at columns[{i}].model: source method needs {key!r}")
            _check_name(model["experiment"], experiments, where, f"columns[{i}].model.experiment")
            _check_name(model["method"], runnable, where, f"columns[{i}].model.method")
        elif "arch" not in model:
            raise ConfigError(f"config error in {where} at columns[{i}].model: source {model['source']} needs 'arch'")
