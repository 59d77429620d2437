"""The fedcore files a job runs, derived from imports, for the rules' code inputs: an edit to code a job executes
reruns it, and an edit to code it does not import reruns nothing.

A job is a workflow script (workflow/scripts/*.py) that imports fedcore modules, plus the plug-ins its run loads by
name (a method, an artifact kind, a pretraining objective, the partition schemes: ``method_module``,
``artifact_module``, ``objective_module``, ``scheme_modules``). Its code is the import closure of those modules: every
fedcore module they import, at module level or inside a function (not under ``TYPE_CHECKING``: never executed),
with the packages above each (their ``__init__.py`` runs first). The graph is read from the source (a static AST
walk over fedcore/, once per process), so nothing is imported to compute it.

The script itself is a code input too, by the same fingerprint (rules/common.smk ``code``): the profiles turn off
Snakemake's ``code`` trigger, which compares a script's time, not its code.

The scripts' own helpers (workflow/scripts/_log.py, _gpu.py, _checkout.py) are workflow glue: where a job logs and
which GPU it takes change no output, and _checkout only makes the job import the fedcore these inputs fingerprint
(the checkout's own), so they and their fedcore modules (runtime.joblog, runtime.jobtime, runtime.gpu_slots) are not
code inputs.

A rule's input is not the module file itself but its fingerprint (``write_fingerprint``): the sha256 of the code
Python runs (the parsed module without comments, layout or docstrings), kept in a small file under
``results/code/`` that is rewritten only when the code changes. Snakemake compares an input's recorded checksum when
its time is newer, so fixing a comment or a docstring, or reformatting, reruns nothing, while any change to what the
module executes reruns every job that imports it. At paper scale an edited comment in the engine would otherwise
rerun every training job (thousands of GPU-hours).
"""
from __future__ import annotations

import ast
import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

from fedcore.io import atomic_path
from fedcore.memo_file import MemoFile

PACKAGE = "fedcore"
ROOT = Path(__file__).resolve().parent  # the fedcore package directory


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package (a package by its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _under_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` test is ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``): its imports never run."""
    return isinstance(test, (ast.Name, ast.Attribute)) and ast.unparse(test).endswith("TYPE_CHECKING")


def _import_records(tree: ast.Module) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every fedcore import a module's source makes, anywhere but under ``if TYPE_CHECKING:``, as written: (level,
    module, names), ``import a.b`` as (0, "a.b", ()); a relative one is resolved against its module by ``_imported``."""
    found: list[tuple[int, str, tuple[str, ...]]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _under_type_checking(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.extend((0, a.name, ()) for a in child.names if a.name.split(".")[0] == PACKAGE)
            elif isinstance(child, ast.ImportFrom) and (child.level or (child.module or "").split(".")[0] == PACKAGE):
                found.append((child.level, child.module or "", tuple(a.name for a in child.names)))
            visit(child)

    visit(tree)
    return found


def _imported(records: list[tuple[int, str, tuple[str, ...]]], module: str, is_package: bool,
              known: dict[str, Path]) -> set[str]:
    """The fedcore modules a module imports: its ``_import_records`` resolved against the module and the package."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str) -> None:
        while name and name not in known:  # `import a.b.c` of an attribute: its module
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for level, base, names in records:
        if level:  # relative: from the importing module's package
            anchor = package.split(".")[: len(package.split(".")) - level + 1]
            base = ".".join(anchor + ([base] if base else []))
        if base.split(".")[0] != PACKAGE:
            continue
        resolve(base)
        for name in names:  # `from package import submodule`
            if f"{base}.{name}" in known:
                found.add(f"{base}.{name}")
    found.discard(module)
    return found


@lru_cache(maxsize=None)
def import_graph(root: Path = ROOT) -> dict[str, frozenset[str]]:
    """Every fedcore module -> the fedcore modules its source imports (module level and inside functions)."""
    known = _module_names(root)
    return {m: frozenset(_imported(source_facts(p)["imports"], m, p.name == "__init__.py", known))
            for m, p in known.items()}


def closure(modules: list[str] | tuple[str, ...], root: Path = ROOT) -> set[str]:
    """``modules`` and every fedcore module they import, directly or not, with the packages above each."""
    graph = import_graph(root)
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        if m not in graph:
            raise ValueError(f"{m} is not a module of {root}")
        seen.add(m)
        parent = m.rpartition(".")[0]
        if parent:
            todo.append(parent)
        todo.extend(graph[m])
    return seen


def module_file(module: str, root: Path = ROOT) -> Path:
    """A fedcore module's file, relative to the package directory (``engine/loop.py``, ``methods/__init__.py``)."""
    path = root.joinpath(*module.split(".")[1:])
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(root)


def script_modules(script: str | Path) -> list[str]:
    """The fedcore modules a workflow script imports itself (not through its helpers _log and _gpu)."""
    tree = ast.parse(Path(script).read_text(encoding="utf-8"), str(script))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == PACKAGE:
            out += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # a name may be a submodule
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if not out:
        raise ValueError(f"{script} imports nothing of fedcore: no code inputs to derive")
    return list(dict.fromkeys(out))


def code_files(*modules: str, script: str | Path | None = None, root: Path = ROOT) -> list[Path]:
    """The files (relative to the fedcore package directory, sorted) of everything ``modules`` and the fedcore modules
    ``script`` imports run: a job's code inputs."""
    graph = import_graph(root)
    # `from fedcore.a import b` in a script names module a.b or an attribute of a: the graph says which
    entry = [m for m in (script_modules(script) if script is not None else []) if m in graph]
    return sorted(module_file(m, root) for m in closure([*entry, *modules], root))


def _docstring_owner(node: ast.AST) -> bool:
    return isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))


def _canonical(node: object) -> str:
    """A parsed node as text: its type and every field, without positions; empty fields left out, so a field that a
    later Python adds empty (3.12's ``type_params``) changes nothing (``ast.dump`` and ``ast.unparse`` do differ
    between 3.11 and 3.12, e.g. in an f-string's quotes)."""
    if isinstance(node, ast.AST):
        fields = ",".join(f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                          if value is not None and value != [])
        return f"{type(node).__name__}({fields})"
    if isinstance(node, list):
        return "[" + ",".join(map(_canonical, node)) + "]"
    return repr(node)


def _strip_docstrings(tree: ast.Module, source: str) -> ast.Module:
    """``tree`` without its docstrings, unless ``source`` reads ``__doc__`` or calls ``getdoc`` (it may print them)."""
    if "__doc__" not in source and "getdoc" not in source:
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if _docstring_owner(node) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _facts(data: bytes, name: str) -> dict:
    """What one parse of a source gives: its code's fingerprint and its fedcore imports (``_import_records``)."""
    source = data.decode("utf-8")
    tree = ast.parse(source, name)
    imports = _import_records(tree)  # read before the docstrings are cut from the tree
    digest = hashlib.sha256(_canonical(_strip_docstrings(tree, source)).encode("utf-8")).hexdigest()
    return {"fingerprint": digest, "imports": imports}


def _cache_version() -> str:
    """This module's own source and Python's version: facts computed under another of either are not reused."""
    return hashlib.sha256(Path(__file__).read_bytes() + repr(sys.version_info[:2]).encode()).hexdigest()


# A source's facts depend on its bytes alone (given this module and Python's parser: the memo's version), so they are
# kept by the bytes' sha256, in this process and, once ``keep_facts_in`` names a file, between processes: every
# `snakemake` call (each dry run, each SLURM job) would otherwise parse the whole package again.
_FACTS = MemoFile(_cache_version)


def source_facts(path: Path) -> dict:
    """A source file's fingerprint (``fingerprint``) and fedcore imports, computed once per distinct content."""
    data = path.read_bytes()
    return _FACTS.get(hashlib.sha256(data).hexdigest(), lambda: _facts(data, str(path)))


def keep_facts_in(file: Path) -> MemoFile:
    """Reuse the source facts saved in ``file`` and save there, at exit, those this process read; the memo."""
    _FACTS.keep_in(file)
    return _FACTS


def fingerprint(path: Path) -> str:
    """The sha256 of a module's code as Python runs it (its AST without docstrings, ``_facts``): equal for two files
    that differ only in comments, layout or docstrings, and the same under Python 3.11 and 3.12."""
    return source_facts(path)["fingerprint"]


@lru_cache(maxsize=None)
def write_fingerprint(source: Path, target: Path, label: str) -> Path:
    """Write ``source``'s fingerprint to ``target`` (once per process), leaving the file untouched when it already
    holds it: the rule input that stands for ``source`` (named ``label`` in the file).

    A new fingerprint file takes the module's own time, so outputs built after the module's last edit stay up to
    date (deleting results/code/ reruns nothing that the module files themselves would not rerun); a changed
    fingerprint is written now, newer than every output. (A results directory from before fingerprints reruns
    every job once: Snakemake sees each rule's set of input files changed.)
    """
    line = f"{fingerprint(source)}  {label} (its code without comments, layout or docstrings)\n"
    new = not target.is_file()
    if new or target.read_text(encoding="utf-8") != line:
        with atomic_path(target) as tmp:
            tmp.write_text(line, encoding="utf-8")
            if new:
                st = source.stat()
                os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    return target
