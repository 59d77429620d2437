"""The resolved configuration (``Resolved``): every experiment mapped onto the chosen scale, with the per-run views
the rules, training and the report read (a run's params, federation, resources; the report's views)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fedcore.config.files import ConfigError, deep_merge


JOB_DEFAULT = {"mem_mb": 48000}  # host memory of a job whose backbones have no `job` entry (paper scale)


TRAIN_KEYS = ("dataset", "backbone", "partition", "federation", "optimizer", "evaluation")


# scale-file keys about the scale itself, not about its experiments
SCALE_SETTINGS = ("missing_weights", "job", "keep_run_state", "results")


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
    # load_config, which made this: at_scale loads another scale with it (the loader imports this module)
    loader: Callable[..., "Resolved"] | None = field(default=None, repr=False, compare=False)
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
            out |= set(cls.extra_datasets(cls.with_defaults(self.method_params(r["experiment"], r["method"]))).values())
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

    def evaluation(self, experiment: str, method: str) -> dict[str, Any]:
        """A run's evaluation: the experiment's, then the method's own schedule (a variant's, else its method's)."""
        exp = self.experiments[experiment]
        own = exp.get("method_evaluation", {})
        return deep_merge(exp["evaluation"], own.get(method, own.get(self.base_method(method), {})))

    def train_params(self, experiment: str, method: str) -> dict[str, Any]:
        """Only what one run depends on, so editing another experiment or method reruns nothing here."""
        exp = self.experiments[experiment]
        out = {k: copy.deepcopy(exp[k]) for k in TRAIN_KEYS}
        out["federation"] = self.federation(experiment, method)
        out["evaluation"] = self.evaluation(experiment, method)
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
            self._scales[scale] = self.loader({**self.top, "scale": scale}, self.root)
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
