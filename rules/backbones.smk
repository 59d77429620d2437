# Backbones: mini-scale ViTs and ResNets are pretrained here on the held-out split no client ever sees;
# paper-scale weights must be a local file (never fetched from a hub inside a job); at smoke scale a missing
# weight file is replaced by a random stand-in written here.
from fedcore.backbones.pretrain import objective_module


rule pretrain_backbone:
    input:
        # the clean embedded digits carry the held-out pretraining split (rendered in every style)
        dataset=dataset_file("digits"),
        code=lambda wc: code("pretrain_backbone.py",
                             objective_module(CFG.backbones[wc.backbone]["pretrain"].get("objective", "supervised"))),
    output:
        f"{RESULTS}/backbones/{{backbone}}.pt",
    params:
        arch=lambda wc: CFG.backbones[wc.backbone]["arch"],
        tag=lambda wc: CFG.backbones[wc.backbone].get("tag"),
        pretrain=lambda wc: CFG.backbones[wc.backbone]["pretrain"],
    log:
        f"{RESULTS}/logs/pretrain_backbone/{{backbone}}.log",
    # two threads, reserved for this job alone: nothing can train before the backbone exists, and with a job
    # beside it a second torch thread cost more in synchronisation than it gained (measured on 2 cores:
    # 2,600-3,000 img/s with 2 threads alone, 1,900 with 1, 530 with 2 beside another job)
    threads: 2
    resources:
        runtime=30,
        mem_mb=4000,
    script:
        "../workflow/scripts/pretrain_backbone.py"


rule backbone_weights:
    """A paper-scale weight file is placed by the user; this rule only explains where and how."""
    output:
        f"{RESOURCES}/weights/{{weights_file}}",
    params:
        backbones=CFG.backbones,
    log:
        f"{RESULTS}/logs/backbone_weights/{{weights_file}}.log",
    script:
        "../workflow/scripts/missing_weights.py"


rule random_backbone:
    """Scale smoke (`missing_weights: random`): fixed random weights, seeded by the arch, in place of a weight file
    that is not under resources/weights/, in the layout of its weight tag (fedcore/backbones/standin.py)."""
    input:
        code=code("random_backbone.py"),
    output:
        f"{RESULTS}/backbones/random/{{backbone}}.safetensors",
    params:
        arch=lambda wc: CFG.backbones[wc.backbone]["arch"],
        tag=lambda wc: CFG.backbones[wc.backbone].get("tag"),
        replaces=lambda wc: f"{RESOURCES}/weights/{CFG.backbones[wc.backbone]['weights']}",
    log:
        f"{RESULTS}/logs/random_backbone/{{backbone}}.log",
    resources:
        runtime=10,
        mem_mb=8000,
    script:
        "../workflow/scripts/random_backbone.py"
