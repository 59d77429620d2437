# Input functions of the probe rules (rules/probes.smk, rules/probes_runs.smk): Snakemake's linter wants functions
# apart from the rules that use them.
from fedcore.methods import is_method as _is_method, method_class as _method_class
from fedcore.selection import table_run_list


def _probe_cfg(name, kind):
    """The figure (or table) `name`, which must be of `kind`: a probe output exists only for that kind."""
    entry = CFG.figures.get(name) or CFG.tables.get(name)
    if entry is None or entry.get("kind") != kind:
        raise ValueError(f"no {kind} figure or table named {name!r} in the report config")
    return entry


def congruence_points(name):
    """One entry per (setting, seed): the run's final.pt and its query transform when the experiment runs that
    method, else why not."""
    fig = _probe_cfg(name, "congruence")
    exp = fig["experiment"]
    configured = CFG.experiments[exp]["methods"]
    out = []
    for p in fig["points"]:
        for seed in CFG.seeds:
            entry = {"value": p["value"], "method": p["method"], "seed": seed}
            if p["method"] in configured:
                entry["path"] = f"{run_dir(exp, p['method'], seed)}/final.pt"
                # the run's Select query transform: K-Means and its groups must see the queries as it did
                params = _method_class(CFG.base_method(p["method"])).with_defaults(CFG.method_params(exp, p["method"]))
                entry["query_relu"] = bool(params.get("query_relu", False))
            else:
                entry["status"] = "not configured"
            out.append(entry)
    return out


def congruence_inputs(wildcards):
    fig = _probe_cfg(wildcards.name, "congruence")
    exp = fig["experiment"]
    files = {artifact_files(exp, p["method"]).get("select_query") for p in fig["points"]} - {None}
    if len(files) != 1:
        raise ValueError(f"figure {wildcards.name}: the swept runs must share one Select-queries file, got {sorted(files)}")
    return {
        "queries": files.pop(),
        "dataset": dataset_file(CFG.experiments[exp]["dataset"]),
        "runs": [p["path"] for p in congruence_points(wildcards.name) if "path" in p],
        "code": code("probe_congruence.py"),
    }


def congruence_groups(wildcards):
    """K of the reference K-Means = G of the swept runs (they must agree)."""
    fig = _probe_cfg(wildcards.name, "congruence")
    exp = fig["experiment"]
    groups = set()
    for p in fig["points"]:
        base = CFG.base_method(p["method"])
        groups.add(int(CFG.method_params(exp, p["method"]).get("groups", _method_class(base).defaults.get("groups"))))
    if len(groups) != 1:
        raise ValueError(f"figure {wildcards.name}: the swept runs use different numbers of groups {sorted(groups)}")
    return groups.pop()


def param_count_inputs(wildcards):
    """The code of every method a column builds: an edit of a method's model changes its count."""
    methods = {method_module(m["base"]) for m in CFG.param_count_models(wildcards.name)
               if m["source"] == "method" and _is_method(m["base"])}
    return {"code": code("probe_param_counts.py", *sorted(methods))}


def tsne_inputs(wildcards):
    exp = CFG.experiments[_probe_cfg(wildcards.name, "tsne")["experiment"]]
    return {
        "dataset": dataset_file(exp["dataset"]),
        "backbone": backbone_file(exp["backbone"]),
        "code": code("probe_tsne.py"),
    }


def transport_runs(name):
    """One entry per configured run of the figure (first seed): label, variant, base method, and the run's
    build_run arguments (trained_run_args, with its artifact files), or why there is none."""
    fig = _probe_cfg(name, "transport_plans")
    exp = fig["experiment"]
    out = []
    for r in fig["runs"]:
        entry = {"label": r["label"], "variant": r["method"], "method": CFG.base_method(r["method"])}
        if r["method"] in CFG.experiments[exp]["methods"]:
            entry["run"] = {**trained_run_args(exp, r["method"], CFG.seeds[0]),
                            "artifacts": artifact_files(exp, r["method"])}
        else:
            entry["status"] = "not configured"
        out.append(entry)
    return out


def transport_inputs(wildcards):
    fig = _probe_cfg(wildcards.name, "transport_plans")
    exp = CFG.experiments[fig["experiment"]]
    built = [r for r in transport_runs(wildcards.name) if "run" in r]
    runs = [r["run"] for r in built]
    return {
        "dataset": dataset_file(exp["dataset"]),
        "partition": partition_file(fig["experiment"], CFG.seeds[0]),
        "backbone": backbone_file(exp["backbone"]),
        "runs": [r["final_path"] for r in runs],
        "artifacts": sorted({f for r in runs for f in r["artifacts"].values()}),
        "code": run_probe_code("probe_transport_plans.py", [r["variant"] for r in built]),
    }


def prompt_tsne_inputs(wildcards):
    fig = _probe_cfg(wildcards.name, "prompt_tsne")
    exp = fig["experiment"]
    if fig["method"] not in CFG.experiments[exp]["methods"]:
        raise ValueError(f"figure {wildcards.name}: method {fig['method']!r} is not run in experiment {exp!r}")
    return {
        "final": f"{run_dir(exp, fig['method'], CFG.seeds[0])}/final.pt",
        "dataset": dataset_file(CFG.experiments[exp]["dataset"]),
        "partition": partition_file(exp, CFG.seeds[0]),
        "code": code("probe_prompt_tsne.py"),
    }


def trained_run_files(exp, method, seed):
    """The files a rebuilt run reads: final.pt, dataset, partition and (if the backbone has one) its weights."""
    x = CFG.experiments[exp]
    out = {"final": f"{run_dir(exp, method, seed)}/final.pt", "dataset": dataset_file(x["dataset"]),
           "partition": partition_file(exp, seed)}
    weights = backbone_file(x["backbone"])
    if weights is not None:
        out["backbone"] = weights
    return out


def trained_run_args(exp, method, seed):
    """load_trained_run's keyword arguments for one run (its paths are the rule's inputs)."""
    files, run = trained_run_files(exp, method, seed), plan(exp, method, seed)
    return {"params": run.params, "identity": run.identity,
            "dataset_path": files["dataset"], "partition_path": files["partition"], "arch": run_archs(exp),
            "weights": files.get("backbone"), "final_path": files["final"], "sha256": run_sha256(exp)}


def run_probe_code(script, methods):
    """The code a probe of trained runs executes: its script's imports and the modules of the runs' methods."""
    return code(script, *sorted({method_module(CFG.base_method(m)) for m in methods}))


def linear_probe_file(exp, method, seed):
    return f"{RESULTS}/probes/linear_probe/{SCALE}/{exp}/{method}/seed{seed}.csv"


def linear_probe_files(name):
    """The per-run probe CSVs a linear_probe table reads: every configured (row's method, column's experiment)
    run, every seed; cells of methods an experiment does not run read nothing (their status says so)."""
    # configured and among the chosen outputs' runs (a headline part of the table trains only its cells)
    return [linear_probe_file(exp, method, s) for exp, method in table_run_list(CFG.tables[name])
            if method in CFG.experiments[exp]["methods"] and CFG.is_selected(exp, method) for s in CFG.seeds]


def linear_probe_inputs(wildcards):
    files = trained_run_files(wildcards.experiment, wildcards.method, wildcards.seed)
    return {**files, "metrics": f"{run_dir(wildcards.experiment, wildcards.method, wildcards.seed)}/metrics.parquet",
            "code": run_probe_code("probe_linear.py", [wildcards.method])}


def probe_panels(name, kind):
    """A run_tsne / attention figure's panels, each with its run's load arguments (first seed), or a status."""
    fig = _probe_cfg(name, kind)
    out = []
    for p in fig["panels"]:
        entry = dict(p)
        if p["method"] in CFG.experiments[p["experiment"]]["methods"]:
            entry["run"] = trained_run_args(p["experiment"], p["method"], CFG.seeds[0])
        else:
            entry["status"] = "not configured"
        out.append(entry)
    return out


def probe_panel_inputs(kind, script):
    def inputs(wildcards):
        panels = probe_panels(wildcards.name, kind)
        files = [f for p in panels if "run" in p
                 for f in trained_run_files(p["experiment"], p["method"], CFG.seeds[0]).values()]
        return {"runs": list(dict.fromkeys(files)),
                "code": run_probe_code(script, [p["method"] for p in panels if "run" in p])}
    return inputs
