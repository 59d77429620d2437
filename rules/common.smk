# Helpers shared by the rule files (paths, wildcard constraints, per-run params); rules live elsewhere.
import glob as _glob

import fedcore
from fedcore.config import run_backbones
from fedcore.data.registry import is_embedded
from fedcore.methods import method_class, method_source, method_sources
from fedcore.plan import experiment_backbones, method_artifacts, plan_run

SCALE = CFG.scale

wildcard_constraints:
    dataset=r"[A-Za-z0-9_]+",
    pid=r"[A-Za-z0-9_]+-[0-9a-f]{8}",
    seed=r"\d+",
    experiment=r"[A-Za-z0-9_]+",
    method=r"[A-Za-z0-9_]+",
    backbone=r"[A-Za-z0-9_]+",
    name=r"[A-Za-z0-9_]+",
    weights_file=r"[A-Za-z0-9_.\-]+",
    artifact=r"[a-z_]+[0-9]*",

# The fedcore package actually imported (an editable install or PYTHONPATH), so code edits are tracked;
# relative to the working directory when it lies inside it, so moving the checkout reruns nothing.
FEDCORE = Path(fedcore.__file__).parent
if FEDCORE.resolve().is_relative_to(Path.cwd().resolve()):
    FEDCORE = FEDCORE.resolve().relative_to(Path.cwd().resolve())

# Engine code every training job runs; an edit here reruns every training job (by design).
ENGINE_SOURCES = sorted(
    _glob.glob(str(FEDCORE / "engine" / "*.py"))
    + [str(FEDCORE / f) for f in ("backbones/images.py", "backbones/prompted.py", "backbones/vit.py",
                                  "backbones/registry.py", "backbones/resnet.py",
                                  "train.py", "methods/base.py", "methods/__init__.py", "io.py", "metrics.py",
                                  "artifacts.py")]
)


def dataset_file(dataset):
    return f"{RESULTS}/data/{dataset}.npz"


def partition_file(exp, seed):
    x = CFG.experiments[exp]
    return f"{RESULTS}/partitions/{x['dataset']}/{x['partition_id']}/seed{seed}.npz"


def backbone_file(name):
    """Pretrained at mini scale by the pipeline; a local weight file at paper scale; None for a backbone trained
    from scratch (`scratch: true`: the run draws its weights)."""
    entry = CFG.backbones[name]
    if entry.get("scratch"):
        return None
    if "pretrain" in entry:
        return f"{RESULTS}/backbones/{name}.pt"
    return f"{RESOURCES}/weights/{entry['weights']}"


def pretrain_code(name):
    """The code a pretraining job runs: the supervised objective's files, and pretrain_moco.py for moco,
    pretrain_clip.py and clip.py for clip."""
    files = ["pretrain.py", "registry.py", "vit.py", "resnet.py"]
    objective = CFG.backbones[name]["pretrain"].get("objective")
    if objective == "moco":
        files.append("pretrain_moco.py")
    if objective == "clip":
        files += ["pretrain_clip.py", "clip.py"]
    return [str(FEDCORE / "backbones" / f) for f in files]


def plan(experiment, method, seed=0):
    """The run's plan (fedcore/plan.py): identity, params, backbones, artifacts; seed matters only for identity."""
    return plan_run(CFG, experiment, method, int(seed))


def run_sha256(experiment):
    """The sha256 of each backbone file a run of the experiment loads, in the order train_inputs lists the files."""
    return experiment_backbones(CFG, experiment)[1]


def run_dir(exp, method, seed):
    return f"{RESULTS}/runs/{SCALE}/{exp}/{method}/seed{seed}"


def all_runs_metrics():
    return [f"{run_dir(r['experiment'], r['method'], r['seed'])}/metrics.parquet" for r in CFG.runs()]


def all_tables():
    return [f"{RESULTS}/tables/{t}.{ext}" for t in CFG.tables if t in CFG.outputs for ext in ("md", "tex", "csv")]


def all_figures():
    return [f"{RESULTS}/figures/{f}.{ext}" for f in CFG.figures if f in CFG.outputs for ext in ("png", "pdf")]


def all_partition_summaries():
    return [
        f"{RESULTS}/partitions/{ds}/{pid}/seed{s}.{ext}"
        for (ds, pid) in CFG.partitions(run_only=True)
        for s in CFG.seeds
        for ext in ("counts.csv", "heatmap.png", "heatmap.pdf")
    ]


def partition_spec(wildcards):
    return CFG.partitions()[(wildcards.dataset, wildcards.pid)]


def artifact_files(exp_name, method):
    """Per-sample artifacts a run reads (Method.artifacts): batch extras name -> file built by rule features."""
    exp = CFG.experiments[exp_name]
    return {name: f"{RESULTS}/features/{exp['backbone']}/{exp['dataset']}/{key}.npz"
            for name, key in method_artifacts(CFG, exp_name, method).items()}


def train_inputs(wildcards):
    p = plan(wildcards.experiment, wildcards.method, wildcards.seed)
    cls = p.method_class
    # the CLIP text-prompt methods also run the CLIP adapter (their text tower) every step
    clip = [str(FEDCORE / "backbones" / "clip.py")] if "clip_tokens" in p.artifacts.values() else []
    out = {
        "dataset": dataset_file(p.dataset),
        "partition": partition_file(wildcards.experiment, wildcards.seed),
        "code": list(dict.fromkeys(ENGINE_SOURCES + [str(FEDCORE / "methods" / f.name)
                                                     for f in method_sources(cls.name)] + clip)),
    }
    if p.backbones:  # none when the method trains its own arch (pFedPT) or every backbone is drawn at random
        files = [backbone_file(b) for b in p.backbones]
        out["backbone"] = files if "client_backbones" in CFG.experiments[wildcards.experiment] else files[0]
    for role, name in p.extra_datasets.items():  # FedMD's public data
        out[f"extra_dataset_{role}"] = dataset_file(name)
    for name, path in artifact_files(wildcards.experiment, wildcards.method).items():
        out[f"artifact_{name}"] = path
    return out


def run_archs(experiment):
    """The arch (or arch.tag) of a run's backbone, or the list of its client backbones'."""
    return experiment_backbones(CFG, experiment)[0]


def identity(wildcards):
    return plan(wildcards.experiment, wildcards.method, wildcards.seed).identity


def dataset_raw_stamp(wildcards):
    if is_embedded(wildcards.dataset):
        return []
    return [f"{RESOURCES}/raw/{wildcards.dataset}.verified.json"]


def dataset_code(wildcards):
    """An embedded dataset is generated by code: an edit of it (e.g. new metadata such as the CLIP class names)
    rebuilds the bundle. Paper datasets are converted once from their verified files."""
    return [str(FEDCORE / "data" / "embedded.py")] if is_embedded(wildcards.dataset) else []
