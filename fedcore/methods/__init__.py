"""Method registry: one module per method under fedcore/methods/, found by name."""
from __future__ import annotations

import importlib
from pathlib import Path

from fedcore.engine.roles import Method

#: method name -> module name under fedcore.methods (one file per method)
METHODS: dict[str, str] = {
    "local": "local",
    "fedavg": "fedavg",
    "head_tune": "head_tune",
    "fedvpt": "fedvpt",
    "fedvpt_d": "fedvpt_d",
    "sgpt": "sgpt",
    "fedmix": "fedmix",
    "fedpr": "fedpr",
    "fedem": "fedem",
    "pfedpg": "pfedpg",
    "per_fedavg": "per_fedavg",
    "fedrep": "fedrep",
    "fedhpl": "fedhpl",
    "fedprox": "fedprox",
    "scaffold": "scaffold",
    "fedbabu": "fedbabu",
    "pfedpt": "pfedpt",
    "fedhe": "fedhe",
    "fedmd": "fedmd",
    "fedproto": "fedproto",
    "fedtgp": "fedtgp",
    "fedgen": "fedgen",
    "fedgh": "fedgh",
    "fedper": "fedper",
    "fedbn": "fedbn",
    "fedrod": "fedrod",
    "fedamp": "fedamp",
    "pfedsd": "pfedsd",
    "pfedgate": "pfedgate",
    "fedcac": "fedcac",
    "fedpft": "fedpft",
    "fedotp": "fedotp",
    "coop": "coop",
    "promptfl": "promptfl",
    "promptfl_fedprox": "promptfl_fedprox",
    "zs_clip": "zs_clip",
}


def method_class(name: str) -> type[Method]:
    """The Method subclass registered under ``name``."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {sorted(METHODS)}")
    module = importlib.import_module(f"fedcore.methods.{METHODS[name]}")
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, Method) and getattr(c, "name", None) == name]
    if len(classes) != 1:
        raise RuntimeError(f"fedcore/methods/{METHODS[name]}.py must define exactly one Method named {name!r}")
    return classes[0]


def method_sources(name: str) -> list[Path]:
    """Every file of fedcore/methods the method's code comes from: its own file and the method modules it imports
    from (a shared base such as global_head.py or fedprox.py), so an edit there reruns its jobs too."""
    module = importlib.import_module(f"fedcore.methods.{METHODS[name]}")
    used = {module.__name__}
    for obj in vars(module).values():
        owner = getattr(obj, "__module__", None) or (obj.__name__ if isinstance(obj, type(module)) else None)
        if isinstance(owner, str) and owner.startswith("fedcore.methods."):
            used.add(owner)
    root = Path(__file__).parent
    return sorted(root / f"{m.rsplit('.', 1)[1]}.py" for m in used)


def method_source(name: str) -> Path:
    """The file that holds only this method's code (a Snakemake input, so edits rerun its jobs)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {sorted(METHODS)}")
    return Path(__file__).parent / f"{METHODS[name]}.py"
