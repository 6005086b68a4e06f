"""What the job refuses: a candidate its gate fails, a cached decision taken under other gate
settings, another target's traffic, and bad option values (before any work)."""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.drafter.manifest import target_fingerprint
from sglang_adaflash.drafter.store import list_versions, verify_version
from sglang_adaflash.serving.traffic import TrafficRecord, TrafficWriter
from training_job import distill
from training_job.opd import round as round_mod

from .distill_volume import N_SGLANG, N_TRAFFIC
from .distill_volume import job_argv as _argv
from .distill_volume import sglang_line as _sglang_line


def _fake_engine(monkeypatch, tau_of):
    """Stand-in decoding: ``tau_of(drafter, sample)`` gives a prompt's tau (20 steps each).

    Both the per-prompt entry point and the per-domain one the job used before are replaced,
    so a test says the same thing whichever the job calls."""
    import training_job.opd.evaluate as evaluate

    def rows(target, drafter, samples, **kw):
        return sorted([s.key, s.domain, round(tau_of(drafter, s) * 20), 20] for s in samples)

    def by_domain(*a, **k):
        out = {}
        for _, domain, tokens, steps in rows(*a, **k):
            t = out.setdefault(domain, {"tau": 0.0, "steps": 0, "tokens": 0, "requests": 0})
            t["steps"] += steps
            t["tokens"] += tokens
            t["requests"] += 1
            t["tau"] = t["tokens"] / t["steps"]
        return out

    monkeypatch.setattr(evaluate, "engine_results", rows, raising=False)
    monkeypatch.setattr(evaluate, "engine_tau", by_domain, raising=False)


def _is_parent(drafter, home) -> bool:
    import torch

    from sglang_adaflash.drafter.checkpoint import read_checkpoint

    parent = read_checkpoint(home / "drafters" / "v000001")[1]["fc.weight"]
    return torch.equal(drafter.state_dict()["fc.weight"].to(parent.dtype), parent)


def _more_traffic(home, n: int, vocab: int) -> None:
    """n more records (half code, half math): enough held-out prompts for the floor."""
    import random

    rng = random.Random(11)
    with TrafficWriter(home, "pod-d") as w:
        for i in range(n):
            w.write(TrafficRecord(
                id=f"x{i}", model="tiny", drafter_version="v000001",
                prompt_ids=[1, 4] + [rng.randrange(8, vocab) for _ in range(4)],
                output_ids=[rng.randrange(8, vocab) for _ in range(8)],
                sampling={"temperature": 0.0}, accept_lens=[1] * 8, finish_reason="length",
                domain=("code", "math")[i % 2], ts=2000.0 + i))


def test_the_floor_refuses_a_candidate_that_loses_a_domain(vol, tmp_path, monkeypatch):
    """Math gains, code loses on every held-out prompt: the mean over domains rises (the old
    gate passed this), the per-domain floor refuses it."""
    pair, home = vol
    _more_traffic(home, 40, pair.vocab_size)
    _fake_engine(monkeypatch, lambda d, s: (2.0 if _is_parent(d, home) else
                                            (3.5 if s.domain == "math" else 1.9)))
    report = tmp_path / "report"
    args = _argv(pair, home, report, "--require-gain", "0", "--min-eval-records", "16",
                 "--max-eval-records", "16", "--epochs", "1")
    assert distill.main(args) == 1
    text = report.read_text()
    assert "gate failed (DomainDrop)" in text and "code -0.1" in text, text
    assert list_versions(home) == ["v000001"]


def test_a_resumed_round_does_not_reuse_a_decision_taken_under_other_gate_settings(
        vol, tmp_path, monkeypatch):
    """A round evaluated without --require-gain dies before publishing, its candidate 5% better
    on every prompt (the gate passed it); rerun with --require-gain 0.5, it must decide under
    the new setting (the settings are in the resume fingerprint), not publish on the cached
    pass."""
    pair, home = vol
    _fake_engine(monkeypatch, lambda d, s: 2.0 if _is_parent(d, home) else 2.1)
    report = tmp_path / "report"
    real = round_mod.publish
    monkeypatch.setattr(round_mod, "publish", lambda *a, **k: (_ for _ in ()).throw(
        OSError("disk full")))
    assert distill.main(_argv(pair, home, report)) == 1
    cached = json.loads((home / "distill" / "work" / "eval.json").read_text())
    assert cached["manifest_eval"]["gate"]["passed"]
    monkeypatch.setattr(round_mod, "publish", real)
    assert distill.main(_argv(pair, home, report, "--require-gain", "0.5")) == 1
    assert "gate failed (NoGain)" in report.read_text()
    assert list_versions(home) == ["v000001"]


def test_another_targets_traffic_is_skipped_and_counted(vol, tmp_path):
    """Token ids past the vocabulary, and a record naming another target's config, fail alone:
    skipped and counted like damaged lines, while the round trains on the rest."""
    pair, home = vol
    with TrafficWriter(home, "pod-c") as w:
        w.write(TrafficRecord(id="oov", model="other", drafter_version=None,
                              prompt_ids=[1, 4, 5], output_ids=[7, pair.vocab_size + 50, 9],
                              sampling={"temperature": 0.0}, accept_lens=[1, 1, 1],
                              finish_reason="length", domain="code", ts=3000.0))
        w.write(TrafficRecord(id="foreign", model="other", drafter_version=None,
                              prompt_ids=[1, 4, 5], output_ids=[7, 8, 9],
                              sampling={"temperature": 0.0}, accept_lens=[1, 1, 1],
                              finish_reason="length", domain="code", ts=3001.0,
                              target_digest="f" * 64))
    with open(home / "traffic" / "pod-b" / "host_0.log", "a") as f:
        f.write(_sglang_line("s-oov", [1, 4, 10 ** 6], [5, 6, 7], "math"))
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report)) == 0
    traffic = verify_version(home, "v000002")["training"]["traffic"]
    assert traffic["skipped"] == {"other_target": 1, "out_of_vocabulary": 2}
    assert traffic["new"] == N_TRAFFIC + N_SGLANG
    # the idle report counts them too
    assert distill.main(_argv(pair, home, report, "--parent", "v000002")) == 3
    idle = json.loads(report.read_text())
    assert idle["skipped"] == {"other_target": 1, "out_of_vocabulary": 2}


def test_records_of_this_target_pass_the_fingerprint_check(vol, tmp_path):
    pair, home = vol
    digest = target_fingerprint(pair.target_dir)["config_digest"]
    with TrafficWriter(home, "pod-c") as w:
        for i in range(4):
            w.write(TrafficRecord(id=f"own{i}", model="tiny", drafter_version=None,
                                  prompt_ids=[1, 4, 5 + i], output_ids=[7, 8, 9, 10],
                                  sampling={"temperature": 0.0}, accept_lens=[1] * 4,
                                  finish_reason="length", domain="code", ts=3000.0 + i,
                                  target_digest=digest))
    assert distill.main(_argv(pair, home, tmp_path / "r", "--min-records", "28")) == 0
    assert "skipped" not in verify_version(home, "v000002")["training"]["traffic"] or \
        not verify_version(home, "v000002")["training"]["traffic"]["skipped"]


@pytest.mark.parametrize("flag,value,says", [
    ("--lr", "nan", "lr must be a finite number > 0"),
    ("--alpha", "1.5", "alpha must be a finite number in [0, 1]"),
    ("--tau", "inf", "tau must be a finite number > 0"),
    ("--eval-fraction", "nan", "--eval-fraction must be in [0, 1)"),
    ("--gate-confidence", "1", "--gate-confidence must lie in [0.5, 1)"),
    ("--require-gain", "nan", "minimum gain must be a finite number"),
    ("--min-records", "0", "--min-records must be >= 1"),
    ("--replay-share", "nan", "--replay-share must be in [0, 4]"),
    ("--replay-share", "-0.5", "--replay-share must be in [0, 4]"),
    ("--standing-eval-records", "-1", "--standing-eval-records must be >= 0"),
])
def test_bad_option_values_are_refused_before_any_work(vol, tmp_path, flag, value, says):
    pair, home = vol
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report, flag, value)) == 2
    assert says in report.read_text()
    assert not (home / "distill").exists()  # no lock, no selection, nothing read
