"""bench.alternating: timing several ways of doing one thing in rounds, so a drift of the
machine's speed falls on each alike."""

from __future__ import annotations

from sglang_adaflash.bench import alternating


def test_round_robin_calls_each_once_a_round_in_order_and_drops_the_first_round(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(alternating.time, "perf_counter", lambda: clock[0])
    calls = []
    cost = {"a": 1.0, "b": 3.0, "c": 2.0}

    def way(k):
        def fn():
            calls.append(k)
            clock[0] += cost[k] * (10.0 if len(calls) <= 3 else 1.0)  # the untimed first round is slow
        return fn

    got = alternating.round_robin_medians({k: way(k) for k in cost}, rounds=1)
    assert calls == ["a", "b", "c"] * 2
    assert got == cost
