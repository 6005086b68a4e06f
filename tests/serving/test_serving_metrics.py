"""ADAFLASH metrics: stats arithmetic, Prometheus exposition (checked by promtool), multiprocess."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from sglang_adaflash.serving.metrics import (
    NO_DOMAIN,
    OTHER_DOMAIN,
    DomainLabeler,
    FanoutSink,
    LoggingSink,
    NullSink,
    SpecStepStats,
)

prom = pytest.importorskip("prometheus_client")

from sglang_adaflash.serving.metrics import PrometheusSink  # noqa: E402


def _stats():
    # B = 8: request 0 verified 5 slots and accepted 3, request 1 verified 8 and accepted 7,
    # request 2 verified 1 slot (no proposals) and accepted 0.
    return SpecStepStats(
        block_size=8,
        candidate_lengths=[5, 8, 1],
        accept_lengths=[3, 7, 0],
        domains=["code", None, "code"],
    )


def test_stats_derived_counts():
    s = _stats()
    assert s.num_drafts == 3
    assert s.num_draft_tokens == 3 * 7
    assert s.num_verified_tokens == 4 + 7 + 0
    assert s.num_accepted_tokens == 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(candidate_lengths=[9], accept_lengths=[0]), "expected 1..8"),
        (dict(candidate_lengths=[0], accept_lengths=[0]), "expected 1..8"),
        (dict(candidate_lengths=[4], accept_lengths=[4]), "must not count the bonus"),
        (dict(candidate_lengths=[4, 4], accept_lengths=[1]), "one accept length"),
        (dict(candidate_lengths=[4], accept_lengths=[1], domains=["a", "b"]), "one domain"),
    ],
)
def test_stats_rejects_inconsistent_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecStepStats(block_size=8, **kwargs)


def test_domain_labeler_caps_cardinality():
    lab = DomainLabeler(max_domains=2)
    assert lab(None) == NO_DOMAIN
    assert lab("") == NO_DOMAIN
    assert lab("a") == "a"
    assert lab("b") == "b"
    assert lab("c") == OTHER_DOMAIN
    assert lab("a") == "a"


def _value(registry, name, labels):
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_prometheus_sink_counts():
    reg = prom.CollectorRegistry()
    sink = PrometheusSink(reg, max_block_size=8)
    sink.observe_step(_stats())
    sink.observe_step(SpecStepStats(block_size=8, candidate_lengths=[2], accept_lengths=[1]))
    code, none = {"domain": "code"}, {"domain": ""}
    assert _value(reg, "adaflash_spec_drafts_total", code) == 2
    assert _value(reg, "adaflash_spec_drafts_total", none) == 2
    assert _value(reg, "adaflash_spec_draft_tokens_total", code) == 14
    assert _value(reg, "adaflash_spec_verified_tokens_total", code) == 4
    assert _value(reg, "adaflash_spec_verified_tokens_total", none) == 7 + 1
    assert _value(reg, "adaflash_spec_accepted_tokens_total", code) == 3
    assert _value(reg, "adaflash_spec_accepted_tokens_total", none) == 8
    # survival: code accepted 3 -> positions 1..3 once; none accepted 7 and 1
    for pos, want in [(1, 1), (3, 1), (4, 0)]:
        got = _value(
            reg, "adaflash_spec_accepted_by_position_total", {"position": str(pos), **code}
        )
        assert got == want, pos
    assert _value(reg, "adaflash_spec_accepted_by_position_total", {"position": "1", **none}) == 2
    assert _value(reg, "adaflash_spec_accepted_by_position_total", {"position": "7", **none}) == 1
    assert _value(reg, "adaflash_candidate_length_count", code) == 2
    assert _value(reg, "adaflash_candidate_length_bucket", {"le": "1.0", **code}) == 1
    assert _value(reg, "adaflash_candidate_length_bucket", {"le": "5.0", **code}) == 2
    assert _value(reg, "adaflash_candidate_length_sum", none) == 8 + 2


def test_prometheus_sink_version_and_reloads():
    reg = prom.CollectorRegistry()
    sink = PrometheusSink(reg)
    sink.set_drafter_version("v000001")
    sink.set_drafter_version("v000002")
    assert _value(reg, "adaflash_drafter_info", {"version": "v000001"}) == 0
    assert _value(reg, "adaflash_drafter_info", {"version": "v000002"}) == 1
    sink.count_reload("success")
    sink.count_reload("rejected")
    sink.count_reload("rejected")
    assert _value(reg, "adaflash_drafter_reloads_total", {"result": "rejected"}) == 2
    with pytest.raises(ValueError, match="not one of"):
        sink.count_reload("weird")
    sink.count_traffic_records(3, "math")
    assert _value(reg, "adaflash_traffic_records_total", {"domain": "math"}) == 3


def _promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); CI installs it")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"promtool rejected the exposition:\n{proc.stdout}{proc.stderr}"
    # promtool prints lint findings without failing; we want none either.
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_exposition_passes_promtool():
    reg = prom.CollectorRegistry()
    sink = PrometheusSink(reg)
    sink.observe_step(_stats())
    sink.set_drafter_version("v000003")
    sink.count_reload("success")
    sink.count_traffic_records(1, None)
    text = prom.generate_latest(reg).decode()
    assert "adaflash_spec_accepted_by_position_total{" in text
    _promtool_check(text)


def test_promtool_catches_a_broken_exposition():
    # guards the helper above: it must be able to fail
    bad = '# TYPE adaflash_x counter\nadaflash_x{a="1" 2\n'
    with pytest.raises(AssertionError):
        _promtool_check(bad)


_CHILD = textwrap.dedent(
    """
    import sys
    from sglang_adaflash.serving.metrics import PrometheusSink, SpecStepStats
    sink = PrometheusSink()
    sink.observe_step(SpecStepStats(block_size=4, candidate_lengths=[4, 2], accept_lengths=[int(sys.argv[1]), 1]))
    sink.set_drafter_version(sys.argv[2])
    sink.count_reload("success")
    """
)


def test_multiprocess_mode_aggregates_scheduler_processes(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for acc, version in [("3", "v000001"), ("2", "v000002")]:
        subprocess.run(
            [sys.executable, "-c", _CHILD, acc, version], env=env, check=True, timeout=120
        )
    from prometheus_client import multiprocess

    reg = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    none = {"domain": ""}
    assert _value(reg, "adaflash_spec_drafts_total", none) == 4
    assert _value(reg, "adaflash_spec_accepted_tokens_total", none) == 3 + 1 + 2 + 1
    assert _value(reg, "adaflash_drafter_reloads_total", {"result": "success"}) == 2
    text = prom.generate_latest(reg).decode()
    assert "adaflash_drafter_info" in text
    _promtool_check(text)


def test_logging_sink_summary(caplog):
    now = [0.0]
    sink = LoggingSink(interval_s=10, clock=lambda: now[0])
    sink.set_drafter_version("v000004")
    sink.observe_step(_stats())
    assert "tau=4.33" in sink.summary()  # 10 accepted / 3 drafts + 1
    assert "accept_rate=0.909" in sink.summary()  # 10 / 11 verified
    with caplog.at_level(logging.INFO):
        now[0] = 11.0
        sink.observe_step(_stats())
    assert any("tau=4.33" in r.message for r in caplog.records)
    assert sink.summary() == "adaflash: no drafts"


def test_fanout_isolates_a_failing_sink():
    class Boom(NullSink):
        def observe_step(self, stats):
            raise RuntimeError("boom")

    seen = []

    class Rec(NullSink):
        def observe_step(self, stats):
            seen.append(stats)

    FanoutSink([Boom(), Rec()]).observe_step(_stats())
    assert len(seen) == 1


def test_bulk_export_equals_one_observation_per_request():
    """PrometheusSink exports a step with one update per series and bucket; the exposition must
    be what one observe/inc per request gives (the reference below). Control: a step with one
    request changed gives a different exposition."""
    import random

    import prometheus_client

    from sglang_adaflash.serving.metrics import PrometheusSink, SpecStepStats

    rng = random.Random(3)
    lens = [rng.randint(1, 8) for _ in range(40)]
    acc = [rng.randint(0, n - 1) for n in lens]
    domains = [rng.choice(["a", "b", None]) for _ in lens]

    def reference(lens, acc, domains):
        reg = prometheus_client.CollectorRegistry()
        sink = PrometheusSink(reg, max_block_size=8)
        for n, a, d in zip(lens, acc, domains):
            d = d or ""
            sink.drafts.labels(d).inc()
            sink.draft_tokens.labels(d).inc(7)
            sink.verified_tokens.labels(d).inc(n - 1)
            sink.accepted_tokens.labels(d).inc(a)
            sink.candidate_length.labels(d).observe(n)
            for pos in range(1, a + 1):
                sink.accepted_by_position.labels(str(pos), d).inc()
        return prometheus_client.generate_latest(reg)

    def bulk(lens, acc, domains):
        reg = prometheus_client.CollectorRegistry()
        PrometheusSink(reg, max_block_size=8).observe_step(SpecStepStats(8, lens, acc, domains))
        return prometheus_client.generate_latest(reg)

    def series(text):  # drop the _created timestamps, which differ run to run
        return sorted(ln for ln in text.decode().splitlines() if "_created" not in ln)

    assert series(bulk(lens, acc, domains)) == series(reference(lens, acc, domains))
    changed = [lens[0] % 8 + 1] + lens[1:]
    assert series(bulk(changed, [0] + acc[1:], domains)) != series(reference(lens, acc, domains))


def test_background_sink_takes_steps_now_and_exports_them_merged():
    from sglang_adaflash.serving.metrics import BackgroundSink, SpecStepStats

    class Rec:
        def __init__(self):
            self.steps, self.versions = [], []

        def observe_step(self, s):
            self.steps.append(s)

        def set_drafter_version(self, v):
            self.versions.append(v)

    rec = Rec()
    sink = BackgroundSink(rec, interval_s=3600)
    sink.observe_step(SpecStepStats(4, [4, 2], [3, 1], ["x", None]))
    sink.observe_step(SpecStepStats(4, [1], [0]))
    sink.set_drafter_version("v000002")  # rare events go through at once
    assert rec.versions == ["v000002"]
    sink.stop()  # flushes what is queued
    (merged,) = rec.steps
    assert merged.candidate_lengths == [4, 2, 1] and merged.accept_lengths == [3, 1, 0]
    assert merged.domains == ["x", None, None]
