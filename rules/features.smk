# Frozen-backbone features computed once per (backbone, dataset, block) and read by every consumer:
# SGPT's Select queries (spec sgpt §1.4) for its runs, the Table 4 clustering and the Fig. 6a K-Means.


rule select_features:
    input:
        dataset=lambda wc: dataset_file(wc.dataset),
        backbone=lambda wc: backbone_file(wc.backbone),
        code=[str(FEDCORE / f) for f in ("features.py", "backbones/vit.py", "backbones/images.py")],
    output:
        f"{RESULTS}/features/{{backbone}}/{{dataset}}/select_block{{block}}.npz",
    params:
        arch=lambda wc: CFG.backbones[wc.backbone]["arch"],
        device=CFG.top["device"],
        threads=CFG.top["threads_per_run"],
    log:
        f"{RESULTS}/logs/select_features/{{backbone}}/{{dataset}}/block{{block}}.log",
    threads: 1
    resources:
        gpu=1 if SCALE == "paper" else 0,
        runtime=60 if SCALE == "paper" else 5,
        mem_mb=32000 if SCALE == "paper" else 2000,
    script:
        "../workflow/scripts/select_features.py"
