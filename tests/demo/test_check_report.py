"""The T=0 comparison and the figures the demo reports, on hand-made inputs."""

from __future__ import annotations

from sglang_adaflash.demo.check import compare, first_difference
from sglang_adaflash.demo.client import Answer
from sglang_adaflash.demo.report import cells, stalls, table, version_windows


def test_equal_outputs_pass_and_one_differing_token_fails():
    ref = {"a": [5, 6, 7], "b": [1, 2]}
    assert compare({"a": [5, 6, 7], "b": [1, 2]}, ref).ok
    eq = compare({"a": [5, 6, 8], "b": [1, 2]}, ref)
    assert not eq.ok and eq.equal == 1 and eq.mismatches[0]["id"] == "a"
    assert eq.mismatches[0]["first_difference"] == 2
    assert eq.mismatches[0]["served"] == [8] and eq.mismatches[0]["reference"] == [7]


def test_a_shorter_or_missing_answer_is_a_mismatch_and_nothing_compared_is_no_pass():
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert not compare({"a": [1, 2]}, {"a": [1, 2, 3]}).ok
    eq = compare({"a": [1]}, {"a": [1], "b": [2]})
    assert not eq.ok and eq.mismatches[0]["id"] == "b"
    assert not compare({}, {}).ok


def _answer(phase, domain, end, parts, tokens=10):
    return Answer(f"{phase}-{end}", phase, domain, end - 1, end, True, completion_tokens=tokens,
                  by_version=[{"version": v, "decode_steps": s, "committed_tokens": t} for v, s, t in parts])


def test_tau_is_split_by_phase_version_and_domain_and_throughput_by_window():
    samples = [{"t": t, "steps": int(t * 10), "version": "v1" if t < 20 else "v2", "running": 1, "waiting": 0}
               for t in range(0, 40)]
    assert version_windows(samples, 40.0) == [("v1", 0, 20, ), ("v2", 20, 40.0)]
    phases = [{"name": "code+prose", "start": 0.0, "end": 10.0}, {"name": "math", "start": 10.0, "end": 40.0}]
    answers = [
        _answer("code+prose", "code", 5, [("v1", 10, 40)]),
        _answer("math", "math", 15, [("v1", 10, 12)]),
        # spans the reload: 4 steps under v1, 5 under v2
        _answer("math", "math", 25, [("v1", 4, 4), ("v2", 5, 20)]),
        _answer("math", "math", 30, [("v2", 5, 15)]),
        Answer("failed", "math", "math", 30, 31, False, error="boom"),
    ]
    rows = cells(answers, phases, samples, 40.0)
    by = {(r["phase"], r["version"]): r for r in rows}
    assert by[("code+prose", "v1")]["tau"] == {"code": 4.0}
    assert by[("math", "v1")]["tau"] == {"math": round(16 / 14, 3)}
    assert by[("math", "v2")]["tau"] == {"math": 3.5}
    assert by[("math", "v2")]["finished"] == 2 and by[("math", "v2")]["tokens_per_s"] == 1.0  # 20 tokens / 20 s
    assert by[("math", "v1")]["from_s"] == 10.0 and by[("math", "v1")]["to_s"] == 20
    assert "tau math" in table(rows, ["code", "math"])


def test_a_stalled_step_counter_while_requests_wait_is_measured():
    samples = [{"t": 0, "steps": 1, "running": 1}, {"t": 1, "steps": 2, "running": 1},
               {"t": 2, "steps": 2, "running": 1}, {"t": 4, "steps": 2, "running": 1},
               {"t": 5, "steps": 3, "running": 1}, {"t": 9, "steps": 3, "running": 0}]
    assert stalls(samples) == 3.0  # 1 -> 4 busy without a step; idle time does not count


def test_the_loop_refuses_mode_ar_and_several_concurrency_levels(tmp_path, capsys):
    from sglang_adaflash.cli.main import main

    assert main(["demo", "--mode", "ar", "--out", str(tmp_path)]) == 2
    assert "serves no drafter" in capsys.readouterr().err
    assert main(["demo", "--concurrency", "1,8", "--out", str(tmp_path)]) == 2
    assert "one --concurrency" in capsys.readouterr().err
    assert main(["demo", "--budget-s", "0", "--out", str(tmp_path)]) == 2
    assert "--budget-s must be" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())
