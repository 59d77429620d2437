"""Paper-scale weights are never fetched inside a job: explain which file to place where."""
from pathlib import Path

target = Path(snakemake.output[0])
sources = [f"{k}: {v.get('source', '')}" for k, v in snakemake.params.backbones.items() if v.get("weights") == target.name]
raise SystemExit(
    f"backbone weight file {target} is missing. Place it there by hand, as its entry's `source:` says (on a "
    "machine with internet; for timm weights e.g. `python -c \"import timm, safetensors.torch as st; m = timm.create_model('<timm name>', pretrained=True, "
    f"num_classes=0); st.save_file(m.state_dict(), '{target.name}')\"`). Registered as: {sources or 'unknown'}"
)
