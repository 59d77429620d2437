"""Random stand-ins for weight files (scale smoke): fixed random weights written in the file's own layout.

At a scale whose file says ``missing_weights: random`` (config/scales/smoke.yaml), a backbone whose ``weights:`` file
is not under resources/weights/ reads a stand-in instead: the arch built from random weights, seeded by the arch's
name (so every run, feature cache and probe of that arch reads the same weights), saved as safetensors in the key
layout its weight tag expects (a MoCo v3 checkpoint's ``base_encoder.*``), and then loaded by the same code as a
real file. The file's metadata says what it is; ``standin_note`` reads it back for the run's log and final.pt. At
any other scale a missing weight file stays an error.
"""
from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import Callable, Mapping

import torch

from fedcore.backbones.registry import BUILDERS, arch_spec, pretrained_cfg
from fedcore.io import atomic_path

log = logging.getLogger(__name__)

METADATA_KEY = "fedcore_random_standin"

# a weight tag's file layout (PretrainedCfg.layout) <- the builder's own keys: the inverse of registry.WEIGHT_LAYOUTS
LAYOUT_WRITERS: dict[str, Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "mocov3": lambda sd: {f"base_encoder.{k}": v for k, v in sd.items()},
}


def standin_seed(arch: str) -> int:
    """The fixed seed of ``arch``'s random stand-in weights."""
    return zlib.crc32(f"fedcore random stand-in {arch}".encode())


def save_random_weights(arch: str, tag: str | None, out_path: str | Path, replaces: str = "") -> None:
    """Write ``arch``'s random stand-in weights (safetensors, the layout of weight tag ``tag``) to ``out_path``
    atomically; ``replaces`` names the weight file it stands in for (recorded in the file's metadata)."""
    from safetensors.torch import save_file

    spec, cfg = arch_spec(arch), pretrained_cfg(arch, tag)
    log.warning("%s is not there: writing RANDOM stand-in weights for arch %s (seed %d) to %s; runs that read them "
                "are not results", replaces or "the weight file", arch, standin_seed(arch), out_path)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(standin_seed(arch))
        model = BUILDERS[spec.source](arch, spec, None, cfg)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.layout:
        sd = LAYOUT_WRITERS[cfg.layout](sd)
    note = {"arch": arch, "tag": tag or spec.default_tag, "seed": standin_seed(arch), "replaces": replaces,
            "what": "random weights standing in for a missing weight file (scale smoke): not pretrained"}
    with atomic_path(out_path, suffix=".safetensors") as tmp:
        save_file(sd, str(tmp), metadata={METADATA_KEY: json.dumps(note)})


def standin_note(path: str | Path | None) -> dict | None:
    """What a random stand-in file says about itself, or None for a real weight file (or no file)."""
    if path is None or not str(path).endswith(".safetensors"):
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else None
