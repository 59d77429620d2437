# Datasets: embedded and synthetic ones are generated; paper-scale ones are downloaded (or placed by hand),
# verified by checksum, then converted once into one .npz bundle per dataset.

# Downloads need the internet, which cluster compute nodes often lack: run them on the submit host.
localrules: fetch_dataset, check_data


rule fetch_dataset:
    input:
        code=code("fetch_dataset.py"),
    output:
        f"{RESOURCES}/raw/{{dataset}}.verified.json",
    params:
        # the resources directory, read off the output (<resources>/raw/<dataset>.verified.json)
        resources=lambda wc, output: str(Path(output[0]).parent.parent),
        checksums=CHECKSUMS,
    log:
        f"{RESULTS}/logs/fetch_dataset/{{dataset}}.log",
    retries: 2
    script:
        "../workflow/scripts/fetch_dataset.py"


rule build_dataset:
    input:
        dataset_raw_stamp,
        code=code("build_dataset.py"),
    output:
        f"{RESULTS}/data/{{dataset}}.npz",
    params:
        resources=RESOURCES,
        checksums=CHECKSUMS,
    log:
        f"{RESULTS}/logs/build_dataset/{{dataset}}.log",
    resources:
        mem_mb=16000,
        runtime=60,
    script:
        "../workflow/scripts/build_dataset.py"


rule check_data:
    """`snakemake check_data`: verify every raw file the configured experiments need; list what is missing."""
    input:
        code=code("check_data.py"),
    output:
        touch(f"{RESULTS}/check_data.{SCALE}.ok"),
    params:
        datasets=CFG.datasets(),
        # the user's weight files (not the pipeline's pretrained ones or random stand-ins, not the scratch
        # backbones that have none)
        weights=[backbone_file(b) for b in CFG.backbones_needed()
                 if backbone_file(b) is not None and "pretrain" not in CFG.backbones[b] and not CFG.uses_standin(b)],
        resources=RESOURCES,
        checksums=CHECKSUMS,
    log:
        f"{RESULTS}/logs/check_data.{SCALE}.log",
    script:
        "../workflow/scripts/check_data.py"
