# Probes on trained runs (FedPFT Tables 1, 4, 5, 8, Figs. 2, 3, 6; spec fedpft §1.12, §7.2): they rebuild a run's
# method from its config slice and final.pt (fedcore/analysis/trained_run.py). Inputs: the run's final.pt (and, for
# the linear probe, its metrics, to check the rebuild), its data, partition and backbone, and the code that builds
# and probes the model (its imports and its methods' modules: rules/common.smk `code`), so an edit of any reruns it.
from fedcore.selection import table_run_list


def _run_identity(exp, method, seed):
    x = CFG.experiments[exp]
    return {"paper": x["paper"], "experiment": exp, "method": method, "scale": SCALE, "dataset": x["dataset"],
            "seed": int(seed)}


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
    files = trained_run_files(exp, method, seed)
    return {"params": CFG.train_params(exp, method), "identity": _run_identity(exp, method, seed),
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


rule linear_probe:
    input:
        unpack(linear_probe_inputs),
    output:
        linear_probe_file("{experiment}", "{method}", "{seed}"),
    params:
        run=lambda wc: trained_run_args(wc.experiment, wc.method, wc.seed),
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/linear_probe/{SCALE}/{{experiment}}/{{method}}/seed{{seed}}.log",
    threads: 1
    resources:
        gpu=1 if SCALE == "paper" else 0,
        runtime=60 if SCALE == "paper" else 5,
        mem_mb=24000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/probe_linear.py"


rule run_tsne:
    input:
        unpack(probe_panel_inputs("run_tsne", "probe_run_tsne.py")),
    output:
        f"{RESULTS}/probes/{{name}}/run_tsne.npz",
    params:
        panels=lambda wc: probe_panels(wc.name, "run_tsne"),
        figure=lambda wc: _probe_cfg(wc.name, "run_tsne"),
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/{{name}}/run_tsne.log",
    threads: 1
    resources:
        gpu=1 if SCALE == "paper" else 0,
        runtime=60 if SCALE == "paper" else 5,
        mem_mb=24000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/probe_run_tsne.py"


rule attention:
    input:
        unpack(probe_panel_inputs("attention", "probe_attention.py")),
    output:
        f"{RESULTS}/probes/{{name}}/attention.npz",
    params:
        panels=lambda wc: probe_panels(wc.name, "attention"),
        figure=lambda wc: _probe_cfg(wc.name, "attention"),
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/probes/{{name}}/attention.log",
    threads: 1
    resources:
        gpu=1 if SCALE == "paper" else 0,
        runtime=60 if SCALE == "paper" else 5,
        mem_mb=24000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/probe_attention.py"
