# Probes: analyses that are not training runs but feed tables and figures (SGPT spec §6.0; FedOTP Figs. A4, A5).
# Each writes results/probes/<table or figure name>/..., read by the table/figure rule of that name.


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
        arch=lambda wc: arch_tag(CFG, CFG.experiments[_probe_cfg(wc.name, "tsne")["experiment"]]["backbone"]),
        sha256=lambda wc: weights_sha256(CFG, CFG.experiments[_probe_cfg(wc.name, "tsne")["experiment"]]["backbone"]),
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
