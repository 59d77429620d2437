# Helpers shared by the rule files (paths, wildcard constraints, per-run params, code inputs); rules live elsewhere.
import functools

import fedcore
from fedcore.code_inputs import code_files, keep_facts_in, write_fingerprint
from fedcore.data.registry import is_generated
from fedcore.estimate import keep_sizes_in
from fedcore.methods import method_module
from fedcore.plan import arch_tag, experiment_backbones, method_artifacts, plan_run, weights_sha256

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

def workdir_relative(path):
    """``path`` relative to the working directory when it lies inside it (a param or input that moves with the
    checkout, so moving the checkout reruns nothing), else as given."""
    path = Path(path)
    if path.resolve().is_relative_to(Path.cwd().resolve()):
        return path.resolve().relative_to(Path.cwd().resolve())
    return path


# The fedcore package actually imported (an editable install or PYTHONPATH), so code edits are tracked.
FEDCORE = workdir_relative(Path(fedcore.__file__).parent)
CHECKSUMS = str(workdir_relative(CFG.checksums_path))  # a param of the data rules

SCRIPTS = Path(workflow.basedir) / "workflow" / "scripts"
# what building the DAG computes from code alone, kept for the next `snakemake` call: each source's parsed facts
# (fingerprint, imports) by its bytes' digest, and the partitions' sizes the paper-scale runtime estimates draw
CACHES = [keep_facts_in(Path(RESULTS, "cache", "code_facts.json")),
          keep_sizes_in(Path(RESULTS, "cache", "partition_sizes.json"))]

onstart:
    # saved once the DAG is built, not only at exit: during a long run each SLURM job builds the DAG again
    for cache in CACHES:
        cache.save()


@functools.lru_cache(maxsize=None)  # asked once per job (~900 at paper scale), derived once per kind of job
def _code(script, modules):
    return (fingerprint_file(SCRIPTS / script, f"workflow/scripts/{script}"),
            *(fingerprint_file(FEDCORE / f, f"fedcore/{f}") for f in code_files(*modules, script=SCRIPTS / script)))


def code(script, *modules):
    """A job's code inputs: its workflow script, the fedcore files that script imports and, with them, the modules
    `modules` its run loads by name (a method, an artifact kind, a pretraining objective, the partition schemes), all
    derived from the imports (fedcore/code_inputs.py), each as its code's fingerprint under results/code/: an edit to
    the code of one reruns the job; an edit to any other file, or to comments and docstrings only, reruns nothing.
    (The script's fingerprint stands in for Snakemake's `code` trigger, which compares the script's time: the
    profiles turn that trigger off.)"""
    return list(_code(script, modules))


def fingerprint_file(source, name):
    """The fingerprint of `source`'s code, results/code/<name>.sha256 (written when the code changed)."""
    return str(write_fingerprint(source, Path(RESULTS, "code", f"{name}.sha256"), name))


def dataset_file(dataset):
    return f"{RESULTS}/data/{dataset}.npz"


def partition_file(exp, seed):
    x = CFG.experiments[exp]
    return f"{RESULTS}/partitions/{x['dataset']}/{x['partition_id']}/seed{seed}.npz"


def backbone_file(name):
    """Pretrained at mini scale by the pipeline; a local weight file at paper scale (at smoke, where that file is
    missing, a random stand-in the pipeline writes); None for a backbone trained from scratch (`scratch: true`:
    the run draws its weights)."""
    entry = CFG.backbones[name]
    if entry.get("scratch"):
        return None
    if "pretrain" in entry:
        return f"{RESULTS}/backbones/{name}.pt"
    if CFG.uses_standin(name):
        return standin_file(name)
    return f"{RESOURCES}/weights/{entry['weights']}"


def standin_file(name):
    """The random stand-in for backbone `name`'s weight file (rule random_backbone)."""
    return f"{RESULTS}/backbones/random/{name}.safetensors"


def plan(experiment, method, seed=0):
    """The run's plan (fedcore/plan.py): identity, params, backbones, artifacts; seed matters only for identity."""
    return plan_run(CFG, experiment, method, int(seed))


def run_sha256(experiment):
    """The sha256 of each backbone file a run of the experiment loads, in the order train_inputs lists the files."""
    return experiment_backbones(CFG, experiment)[1]


def run_state(path):
    """A run's final.pt: kept, or a temporary file where the scale keeps no run state (smoke: Snakemake deletes it
    once the probes that read it have run)."""
    return path if CFG.keep_run_state else temp(path)


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
    out = {
        "dataset": dataset_file(p.dataset),
        "partition": partition_file(wildcards.experiment, wildcards.seed),
        "code": code("train.py", *p.modules),  # its method's and its artifacts' modules: imported by name
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
    """A downloaded dataset's verified raw files; none for a generated one (embedded or synthetic)."""
    if is_generated(wildcards.dataset):
        return []
    return [f"{RESOURCES}/raw/{wildcards.dataset}.verified.json"]
