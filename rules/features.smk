# Per-sample artifacts computed once per (backbone, dataset, key) and read by every consumer
# (fedcore/artifacts/): e.g. cls_block<b>, SGPT's Select queries (spec sgpt §1.4), also read by the
# Table 4 clustering and the Fig. 6a K-Means; clip_tokens, the frozen CLIP's image tokens (FedOTP).
from fedcore.artifacts import artifact_module


rule features:
    input:
        dataset=lambda wc: dataset_file(wc.dataset),
        backbone=lambda wc: backbone_file(wc.backbone),
        code=lambda wc: code("features.py", artifact_module(wc.artifact)),  # its kind's module: imported by name
    output:
        f"{RESULTS}/features/{{backbone}}/{{dataset}}/{{artifact}}.npz",
    params:
        arch=lambda wc: arch_tag(CFG, wc.backbone),  # with its weight tag: the weights' input contract
        sha256=lambda wc: weights_sha256(CFG, wc.backbone),  # checked before any work
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/features/{{backbone}}/{{dataset}}/{{artifact}}.log",
    threads: 1
    resources:
        gpu=1 if SCALE == "paper" else 0,
        runtime=60 if SCALE == "paper" else 5,
        mem_mb=32000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/features.py"
