# One training job per (experiment, method, seed). Its params are only that run's slice of the
# config and its code inputs are the engine plus that method's file, so an edit reruns only the
# jobs it can change.


rule train:
    input:
        unpack(train_inputs),
    output:
        metrics=f"{RESULTS}/runs/{SCALE}/{{experiment}}/{{method}}/seed{{seed}}/metrics.parquet",
        final=run_state(f"{RESULTS}/runs/{SCALE}/{{experiment}}/{{method}}/seed{{seed}}/final.pt"),
    params:
        cfg=lambda wc: CFG.train_params(wc.experiment, wc.method),
        identity=identity,
        arch=lambda wc: run_archs(wc.experiment),
        sha256=lambda wc: run_sha256(wc.experiment),
        # outside the outputs, so that Snakemake keeps them when it reruns an interrupted job: the last
        # per-round state (kept after the run, to rebuild outputs Snakemake deleted as incomplete) and
        # the log of every attempt (Snakemake deletes the job's log before each one); no checkpoint where the scale
        # keeps no run state (smoke)
        checkpoint=lambda wc: f"{run_dir(wc.experiment, wc.method, wc.seed)}/checkpoint.pt" if CFG.keep_run_state
        else None,
        log_history=lambda wc: f"{run_dir(wc.experiment, wc.method, wc.seed)}/attempts.log",
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
        compile=CFG.top["compile_one_pass"],
        deterministic=CFG.top["deterministic"],
    log:
        f"{RESULTS}/logs/train/{SCALE}/{{experiment}}/{{method}}/seed{{seed}}.log",
    threads: 1
    resources:
        gpu=lambda wc: CFG.run_resources(wc.experiment, wc.method)["gpu"],
        runtime=lambda wc: CFG.run_resources(wc.experiment, wc.method)["runtime"],
        mem_mb=lambda wc: CFG.run_resources(wc.experiment, wc.method)["mem_mb"],
    script:
        "../workflow/scripts/train.py"
