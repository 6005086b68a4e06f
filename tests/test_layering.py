"""The package's layers, checked: subpackages import one another without cycles, and the small
core under the engine, the target and the SGLang plugin imports nothing above it.

Imports inside functions count too: a lazy import still makes the two packages depend on each
other, it only hides it from the import-time order.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sglang_adaflash"


def _package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        here = parts[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against the module's own package
                    base = list(parts[:-1])[: len(parts) - node.level]
                    mod = [*base, *(node.module.split(".") if node.module else [])]
                    if not mod:  # `from .. import x`: x is a top-level package or module
                        names = [a.name for a in node.names]
                    else:
                        names = [mod[0]]
                elif node.module and node.module.startswith("sglang_adaflash."):
                    names = [node.module.split(".")[1]]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names
                         if a.name.startswith("sglang_adaflash.")]
            graph[here].update(n for n in names if n != here)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_subpackages_import_each_other_without_cycles():
    cycle = _cycle(_package_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_core_and_the_planner_sit_below_the_engine_the_target_and_the_plugin():
    g = _package_graph()
    assert g["core"] <= set(), f"core imports {sorted(g['core'])}"
    assert g["planner"] <= {"core"}, f"planner imports {sorted(g['planner'])}"
    assert "engine" not in g["target"] and "engine" not in g["sglang_plugin"]
    assert {"core", "planner"} <= g["engine"]


def test_the_checker_sees_a_cycle_and_a_lazy_import(tmp_path):
    """Control: a function-level import that closes a loop is found."""
    pkg = tmp_path / "pkg"
    for name, body in {"a/__init__.py": "", "a/m.py": "from ..b import x\n",
                       "b/__init__.py": "", "b/n.py": "def f():\n    from ..a.m import y\n",
                       "c.py": "from .a import m\n"}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(body)
    g = _package_graph(pkg)
    assert g["a"] == {"b"} and g["b"] == {"a"} and g["c"] == {"a"}
    assert _cycle(g) in (["a", "b", "a"], ["b", "a", "b"])


TRAINING = Path(__file__).resolve().parents[1] / "training_job"


def _module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (function-level imports too), at
    module granularity: ``training_job.opd.round`` -> ``training_job.opd.train``, ..."""
    modules = {".".join((package, *p.relative_to(root).with_suffix("").parts)).removesuffix(
        ".__init__"): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")[: len(mod.split(".")) - node.level + int(is_pkg)]
                    stem = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" for a in node.names] + [stem]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in modules and t != mod:
                    graph[mod].add(t)
                    break
    return graph


def test_the_training_job_modules_import_each_other_without_cycles():
    """The distillation job's entry point sits above the round, the round above its parts, and
    nothing below imports the entry point back (`training_job.distill` <-> `opd.follow` was a
    cycle); the offline recipe's functions import nothing above them."""
    g = _module_graph(TRAINING, "training_job")
    cycle = _cycle(g)
    assert cycle is None, " -> ".join(cycle or [])
    assert "training_job.distill" in g and "training_job.opd.round" in g["training_job.distill"]
    below = {m for m in g if m.startswith("training_job.opd.")}
    assert not any("training_job.distill" in g[m] for m in below)
    assert not g["training_job.dflash_offline"] & {"training_job.recipe", "training_job.distill"}


def test_the_module_checker_sees_a_lazy_cycle(tmp_path):
    """Control: a function-level import that closes a loop between two modules is found."""
    pkg = tmp_path / "pkg"
    for name, body in {"__init__.py": "", "a.py": "from . import b\n",
                       "sub/__init__.py": "", "sub/b.py": "",
                       "b.py": "def f():\n    from .a import x\n"}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(body)
    g = _module_graph(pkg, "pkg")
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.a"}
    assert _cycle(g) is not None


def test_the_engines_parts_do_not_import_the_engine_back():
    """`engine.engine` builds on the draft-or-not choice and the sizing profile; neither imports
    it back (each was a cycle, through imports for type hints: they name what they read of the
    engine as a Protocol of their own)."""
    g = _module_graph(ROOT, "sglang_adaflash")
    assert {"sglang_adaflash.engine.draft_choice", "sglang_adaflash.engine.sizing"} <= g["sglang_adaflash.engine.engine"]
    for part in ("draft_choice", "sizing"):
        assert "sglang_adaflash.engine.engine" not in g[f"sglang_adaflash.engine.{part}"], part


def test_the_package_modules_import_each_other_without_cycles():
    """At module granularity too, lazy imports included: `core.rejection` <-> `core.flashinfer_sampling`
    (VerifyResult now lives in core.verify_result) and `engine.engine` <-> `engine.admission`
    (the running request's state now lives in engine.step_state) were cycles inside one
    subpackage, which the subpackage graph above cannot see."""
    g = _module_graph(ROOT, "sglang_adaflash")
    cycle = _cycle(g)
    assert cycle is None, " -> ".join(cycle or [])
    assert "sglang_adaflash.engine.step_state" in g["sglang_adaflash.engine.admission"]
