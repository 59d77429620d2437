"""fedcore's import graph (fedcore/code_inputs.py: every import, at module level or in a function): no circles, and
imports that run one way: scripts -> fedcore top -> engine -> backbones/data; methods use the engine, the engine never
imports a method, the report or the analyses, and a training run imports no report, analysis or configuration code."""
from __future__ import annotations

from fedcore.artifacts import KINDS
from fedcore.code_inputs import closure, import_graph
from fedcore.methods import method_module, method_names


def _cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _within(modules: set[str], *packages: str) -> set[str]:
    """The modules of ``modules`` that lie in (or are) one of ``packages``."""
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)}


def test_no_import_circles():
    assert _cycles(dict(import_graph())) == []


def test_a_circle_is_found():
    """The check itself: a two-module circle and a self-contained chain."""
    graph = {"a": frozenset({"b"}), "b": frozenset({"a", "c"}), "c": frozenset()}
    assert _cycles(graph) == [["a", "b"]]


def test_the_engine_imports_no_method_report_or_analysis():
    engine = [m for m in import_graph() if _within({m}, "fedcore.engine")]
    assert _within(closure(engine), "fedcore.methods", "fedcore.report", "fedcore.analysis", "fedcore.train") == set()


def test_backbones_and_data_import_nothing_above_them():
    low = [m for m in import_graph() if _within({m}, "fedcore.backbones", "fedcore.data")]
    assert _within(closure(low), "fedcore.engine", "fedcore.methods", "fedcore.report", "fedcore.analysis",
                   "fedcore.train", "fedcore.config") == set()


def test_a_training_run_imports_no_report_analysis_or_configuration():
    """fedcore.train with any registered method and every artifact kind: the code a training job can import."""
    kinds = [f"fedcore.artifacts.{k.module}" for k in KINDS.values()]
    for name in method_names():
        imported = closure(["fedcore.train", method_module(name), *kinds])
        assert _within(imported, "fedcore.report", "fedcore.analysis", "fedcore.config", "fedcore.selection",
                       "fedcore.claim_rules", "fedcore.plan", "fedcore.estimate") == set(), name
        assert _within(imported, "fedcore.methods") <= _within(closure([method_module(name)]), "fedcore.methods"), name


def test_the_config_imports_no_report_code():
    """The config checks claims and picks the runs they need with fedcore/claim_rules.py (a claim as data); the
    report fills the claims' grids with built cells, the config never imports it."""
    assert _within(closure(["fedcore.config"]), "fedcore.report", "fedcore.analysis") == set()


def test_the_config_files_loader_imports_nothing_else_of_fedcore():
    """Reading, merging and schema-validating the config files (fedcore/config/files.py) needs no other fedcore code:
    the names a value may take (papers, datasets, backbones) are handed in by the caller."""
    assert _within(import_graph()["fedcore.config.files"], "fedcore") == set()
