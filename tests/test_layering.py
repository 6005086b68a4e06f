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
