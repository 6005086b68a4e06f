"""`adaflash demo` end to end on a tiny random pair: two real child processes, a real round.

The pair is the tiny one in float64 (so T=0 argmaxes never tie and the final comparison with
plain decoding is exact). Its drafter is random, so live tau does not rise here; what is tested
is the orchestration: both phases through the openai client, a round published and hot-reloaded
while serving, zero failed requests, the reload pause measured, the T=0 check, the outputs, and
the children stopped on every path.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from argparse import Namespace
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from sglang_adaflash.cli.main import main  # noqa: E402
from sglang_adaflash.demo import client as demo_client  # noqa: E402
from sglang_adaflash.demo.check import compare  # noqa: E402
from sglang_adaflash.demo.client import Answer  # noqa: E402
from sglang_adaflash.demo.loop import finish  # noqa: E402
from sglang_adaflash.demo.plan import QUICK  # noqa: E402
from sglang_adaflash.testing.tiny_pair import build_tiny_pair  # noqa: E402

from .test_procs import wait_dead  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("demo-pair") / "pair", seed=0, dtype="float64")


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The demo's temporary volume goes here, so the test sees that it is removed."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def demo_argv(pair, out, *extra):
    return ["demo", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
            "--dtype", "float64", "--quick", "--first-requests", "2", "--min-records", "6",
            "--max-records", "8", "--rounds", "1", "--epochs", "1", "--head-steps", "1",
            "--per-version", "2", "--check-prompts", "3", "--max-new-tokens", "6",
            "--concurrency", "2", "--budget-s", "90", "--out", str(out), "--quiet", *extra]


def child_pids(out) -> list[int]:
    return list(json.loads((out / "logs" / "processes.json").read_text()).values())


@pytest.mark.slow  # two child processes and a round: about a minute on 2 shared cores
def test_the_loop_serves_distils_reloads_and_checks_t0(pair, tmp_path, scratch, capsys):
    out = tmp_path / "out"
    rc = main(demo_argv(pair, out))
    printed = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    s = doc["summary"]
    assert rc == 0, (printed, s)
    assert s["failed_requests"] == 0 and s["poll_failures"] == 0 and s["children_failed"] == {}
    assert s["versions_loaded"][0] == "v000002"  # published by the follower, swapped in while serving
    assert [p["name"] for p in doc["phases"]] == ["code+prose", "math", "code+prose again"]
    # plain decoding answered every other prompt in the same run, and each cell has its ratio
    assert s["plain_answers"] > 0
    assert sum(a["server"] == "plain" for a in doc["answers"]) == s["plain_answers"]
    assert any(r["vs_plain"] for r in doc["cells"] if r["phase"] == "math")
    assert s["math_vs_plain_first_to_last"] and s["math_vs_plain_goal"]["goal"] == 1.3
    assert set(s["first_domains_before_after"]) == {"code", "prose"}
    math_versions = {r["version"] for r in doc["cells"] if r["phase"] == "math" and "math" in r["tau"]}
    assert {"v000001", s["versions_loaded"][-1]} <= math_versions
    first = next(r for r in doc["cells"] if r["phase"] == "code+prose")
    assert set(first["tau"]) == {"code", "prose"} and first["version"] == "v000001"
    for swap in doc["swaps"]:
        assert swap["pause_s"] >= 0 and swap["pause_steps"] is not None and swap["t"] > 0
    assert s["t0_equal_to_ar"] and doc["equality"]["compared"] == 3
    assert s["check_versions"] == [s["versions_loaded"][-1]]
    assert {v["version"] for v in doc["versions"]} >= {"v000001", "v000002"}
    assert "EQUAL (3/3)" in printed and "tau math" in printed and "vs ar math" in printed
    assert "math speed against plain decoding" in printed
    assert (out / "closed_loop.png").stat().st_size > 0
    assert all(wait_dead(pid) for pid in child_pids(out))
    assert os.listdir(scratch) == []  # the temporary volume is gone


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_both_children_are_stopped_when_the_demo_fails(pair, tmp_path, scratch, monkeypatch, raised):
    def broken(self, prompts, phase, **kw):
        time.sleep(0.5)
        raise raised("the client broke")

    monkeypatch.setattr(demo_client.Replayer, "run", broken)
    out = tmp_path / "out"
    if raised is KeyboardInterrupt:  # Ctrl-C: status 130
        assert main(demo_argv(pair, out)) == 130
    else:  # a bug: the traceback surfaces, after the clean-up
        with pytest.raises(RuntimeError, match="the client broke"):
            main(demo_argv(pair, out))
    pids = child_pids(out)
    assert len(pids) == 3 and all(wait_dead(pid, 5) for pid in pids)
    assert os.listdir(scratch) == []


def _finish(tmp_path, served, reference, answers_ok=True):
    args = Namespace(mode="dflash", dtype="float64", threads=1, argv_shown=[])
    answers = [Answer("a", "math", "math", 1.0, 2.0, answers_ok, None if answers_ok else "boom",
                      completion_tokens=4, fingerprint="v1",
                      by_version=[{"version": "v1", "decode_steps": 2, "committed_tokens": 4}])]
    state = {"answers": answers, "phases": [{"name": "math", "start": 0.0, "end": 3.0}],
             "swaps": [], "failed_children": {}}
    poller = SimpleNamespace(samples=[{"t": 0.0, "steps": 0, "version": "v1", "running": 0, "waiting": 0}],
                             failures=0)
    return finish(args, QUICK, tmp_path, state, poller, [], compare(served, reference), 3.0, 2,
                  lambda msg: None)


def test_the_verdict_fails_on_a_differing_token_or_a_failed_request(tmp_path, capsys):
    assert _finish(tmp_path, {"p": [1, 2, 3]}, {"p": [1, 2, 3]}) == 0
    assert _finish(tmp_path, {"p": [1, 2, 3]}, {"p": [1, 9, 3]}) == 1
    assert "DIFFERENT (0/1)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["equality"]["mismatches"][0]["first_difference"] == 1
    assert _finish(tmp_path, {"p": [1]}, {"p": [1]}, answers_ok=False) == 1


def test_speed_is_a_ratio_to_plain_decoding_of_the_same_prompts_in_the_run():
    """Each (phase, version, domain) cell's speed is the speculative answers' tokens/s over the
    plain server's on the same prompts; plain answers never count as the drafter's tau."""
    from sglang_adaflash.demo.report import cells, table

    def spec(pid, domain, t0, t1, version, tokens=12, steps=4):
        return Answer(pid, "math", domain, t0, t1, True, completion_tokens=tokens, fingerprint=version,
                      by_version=[{"version": version, "decode_steps": steps, "committed_tokens": tokens}])

    def plain(pid, domain, t0, t1, tokens=12):
        return Answer(pid, "math", domain, t0, t1, True, completion_tokens=tokens, server="plain",
                      by_version=[{"version": None, "decode_steps": tokens, "committed_tokens": tokens}])

    answers = [spec("a", "math", 0.0, 1.0, "v1"), plain("a", "math", 1.0, 3.0),  # 12 vs 6 tok/s
               spec("b", "math", 3.0, 4.0, "v1"), plain("b", "math", 4.0, 5.0),  # 12 vs 12
               spec("c", "math", 5.0, 6.0, "v1"),  # unpaired: in tau, not in the ratio
               spec("d", "math", 6.0, 7.0, "v2", steps=2), plain("d", "math", 7.0, 10.0)]  # 12 vs 4
    phases = [{"name": "math", "start": 0.0, "end": 10.0}]
    samples = [{"t": 0.0, "version": "v1"}, {"t": 6.0, "version": "v2"}]
    rows = {r["version"]: r for r in cells(answers, phases, samples, 10.0)}
    assert rows["v1"]["vs_plain"]["math"] == round((24 / 2) / (24 / 3), 3)  # 1.5
    assert rows["v1"]["speed"]["math"]["pairs"] == 2
    assert rows["v1"]["tau"]["math"] == 3.0  # 36 tokens over 12 steps: the plain answers left out
    assert rows["v2"]["vs_plain"]["math"] == 3.0 and rows["v2"]["tau"]["math"] == 6.0
    text = table(list(rows.values()), ["math"])
    assert "vs ar math" in text and "1.50x" in text and "3.00x" in text


def test_every_domain_gets_its_own_plain_baseline():
    """Prompts alternate code and prose in the first phase: counting answers over the phase would
    pair only code with plain decoding (every other prompt); the count is per domain."""
    from sglang_adaflash.demo.workload import Prompt

    class Fake(demo_client.Replayer):
        def __init__(self, server, **kw):  # no HTTP client: ask() is replaced
            self.concurrency, self.server, self.baseline = 1, server, kw.get("baseline")
            self.baseline_every = kw.get("baseline_every", 2)

        def ask(self, prompt, phase, max_tokens=None, token_ids=False):
            return Answer(prompt.id, phase, prompt.domain, 0.0, 1.0, True, server=self.server), None

    spec = Fake("spec", baseline=Fake("plain"), baseline_every=2)
    prompts = [Prompt(f"p{i}", "code" if i % 2 == 0 else "prose", "x") for i in range(8)]
    answers = spec.run(iter(prompts), "code+prose")
    plain = [a for a in answers if a.server == "plain"]
    assert sorted(a.domain for a in plain) == ["code", "code", "prose", "prose"]
