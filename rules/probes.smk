# Probes: analyses that are not training runs but feed tables and figures (SGPT spec §6.0; FedOTP Figs. A4, A5).
# Each writes results/probes/<table or figure name>/..., read by the table/figure rule of that name.
from fedcore.methods import is_method as _is_method, method_class as _method_class


def _probe_cfg(name, kind):
    """The figure (or table) `name`, which must be of `kind`: a probe output exists only for that kind."""
    entry = CFG.figures.get(name) or CFG.tables.get(name)
    if entry is None or entry.get("kind") != kind:
        raise ValueError(f"no {kind} figure or table named {name!r} in the report config")
    return entry


def congruence_points(name):
    """One entry per (setting, seed): the run's final.pt when the experiment runs that method, else why not."""
    fig = _probe_cfg(name, "congruence")
    exp = fig["experiment"]
    configured = CFG.experiments[exp]["methods"]
    out = []
    for p in fig["points"]:
        for seed in CFG.seeds:
            entry = {"value": p["value"], "method": p["method"], "seed": seed}
            if p["method"] in configured:
                entry["path"] = f"{run_dir(exp, p['method'], seed)}/final.pt"
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
    """One entry per configured run of the figure (first seed): label, base method, its params, and the run's
    final.pt, or why there is none."""
    fig = _probe_cfg(name, "transport_plans")
    exp = fig["experiment"]
    out = []
    for r in fig["runs"]:
        entry = {"label": r["label"], "variant": r["method"], "method": CFG.base_method(r["method"]),
                 "params": CFG.method_params(exp, r["method"])}
        if r["method"] in CFG.experiments[exp]["methods"]:
            entry["path"] = f"{run_dir(exp, r['method'], CFG.seeds[0])}/final.pt"
        else:
            entry["status"] = "not configured"
        out.append(entry)
    return out


def transport_inputs(wildcards):
    fig = _probe_cfg(wildcards.name, "transport_plans")
    exp = CFG.experiments[fig["experiment"]]
    return {
        "dataset": dataset_file(exp["dataset"]),
        "partition": partition_file(fig["experiment"], CFG.seeds[0]),
        "backbone": backbone_file(exp["backbone"]),
        "runs": [r["path"] for r in transport_runs(wildcards.name) if "path" in r],
        "code": code("probe_transport_plans.py", *sorted({method_module(r["method"]) for r in transport_runs(wildcards.name)
                                                           if "path" in r})),
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


rule transport_plans:
    input:
        unpack(transport_inputs),
    output:
        f"{RESULTS}/probes/{{name}}/transport_plans.npz",
    params:
        figure=lambda wc: _probe_cfg(wc.name, "transport_plans"),
        runs=lambda wc: transport_runs(wc.name),
        arch=lambda wc: run_archs(_probe_cfg(wc.name, "transport_plans")["experiment"]),
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/{{name}}/transport_plans.log",
    threads: 1
    resources:
        gpu=1 if SCALE == "paper" else 0,
        runtime=30 if SCALE == "paper" else 5,
        mem_mb=8000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/probe_transport_plans.py"


rule prompt_tsne:
    input:
        unpack(prompt_tsne_inputs),
    output:
        f"{RESULTS}/probes/{{name}}/prompt_tsne.npz",
    params:
        figure=lambda wc: _probe_cfg(wc.name, "prompt_tsne"),
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/{{name}}/prompt_tsne.log",
    threads: 1
    resources:
        runtime=10,
        mem_mb=4000,
    script:
        "../workflow/scripts/probe_prompt_tsne.py"


rule param_counts:
    input:
        unpack(param_count_inputs),
    output:
        f"{RESULTS}/probes/{{name}}/param_counts.csv",
    params:
        models=lambda wc: CFG.param_count_models(wc.name),
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/{{name}}/param_counts.log",
    resources:
        runtime=10,
        mem_mb=4000,
    script:
        "../workflow/scripts/probe_param_counts.py"


rule tsne_embedding:
    input:
        unpack(tsne_inputs),
    output:
        f"{RESULTS}/probes/{{name}}/tsne.npz",
    params:
        figure=lambda wc: _probe_cfg(wc.name, "tsne"),
        arch=lambda wc: CFG.backbones[CFG.experiments[_probe_cfg(wc.name, "tsne")["experiment"]]["backbone"]]["arch"],
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/{{name}}/tsne.log",
    threads: 1
    resources:
        gpu=1 if SCALE == "paper" else 0,
        runtime=60 if SCALE == "paper" else 5,
        mem_mb=16000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/probe_tsne.py"


rule congruence:
    input:
        unpack(congruence_inputs),
    output:
        f"{RESULTS}/probes/{{name}}/congruence.csv",
    params:
        points=lambda wc: congruence_points(wc.name),
        k=congruence_groups,
        seed=lambda wc: int(_probe_cfg(wc.name, "congruence").get("seed", 0)),
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/{{name}}/congruence.log",
    threads: 1
    resources:
        runtime=60 if SCALE == "paper" else 5,
        mem_mb=16000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/probe_congruence.py"
