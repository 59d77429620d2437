# Probes on trained runs (FedPFT Tables 1, 4, 5, 8, Figs. 2, 3, 6; spec fedpft §1.12, §7.2): they rebuild a run's
# method from its config slice and final.pt (fedcore/analysis/trained_run.py). Inputs: the run's final.pt (and, for
# the linear probe, its metrics, to check the rebuild), its data, partition and backbone, and the code that builds
# and probes the model (its imports and its methods' modules: rules/common.smk `code`), so an edit of any reruns it.
# Their input functions live in rules/common_probes.smk.


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
