"""benchmarks/adaptive/signals.py: how much of a draft's fate is known before drafting.

Its statistics are the evidence docs/engine.md cites for the posterior's idle fade, so each is
checked on tables written here with a known answer, beside a control that must read otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench.conftest import load_benchmark


@pytest.fixture(scope="module")
def signals():
    return load_benchmark("adaptive/signals.py")


def _smooth(n: int, period: int, phase: int) -> list[int]:
    """accepted[0] = 0, then a slow wave: neighbouring positions alike."""
    return [0] + [int(3 + 3 * np.sin(2 * np.pi * (m + phase) / period)) for m in range(1, n)]


def test_lag_correlation_is_high_for_a_slow_signal_and_about_zero_for_noise(signals):
    smooth = [_smooth(200, 64, p) for p in range(4)] + [[0] + [3] * 20]  # one stopped early
    got = signals.lag_correlation(smooth, lags=(1, 32))
    assert got[1] > 0.9 and got[32] < -0.5  # half a period on: the opposite phase
    rng = np.random.default_rng(0)
    noise = [[0] + rng.integers(0, 6, 400).tolist() for _ in range(4)]  # the control
    assert abs(signals.lag_correlation(noise, lags=(1,))[1]) < 0.1


def test_request_share_is_the_between_request_part_of_the_variance(signals):
    apart = [[0] + [1] * 10, [0] + [5] * 90]  # every bit of variance is between the two
    assert signals.request_share(apart) == pytest.approx(1.0)
    rng = np.random.default_rng(1)
    alike = [[0] + rng.integers(0, 6, 300).tolist() for _ in range(2)]  # the control: one distribution
    assert signals.request_share(alike) < 0.02


def test_chain_steps_on_by_accepted_plus_one_and_pairs_consecutive_steps(signals):
    #        m: 0  1  2  3  4  5  6  7  8
    table = [0, 2, 9, 9, 1, 9, 0, 3, 9]
    got = signals.chain([table])
    # steps at m = 1 (accepts 2) -> 4 (1) -> 6 (0) -> 7 (3) -> 11: pairs (2,1), (1,0), (0,3)
    assert got["pairs"] == 3
    assert got["by_last"] == {0: {"steps": 1, "next_mean": 3.0, "next_any": 1.0},
                              1: {"steps": 1, "next_mean": 0.0, "next_any": 0.0},
                              2: {"steps": 1, "next_mean": 1.0, "next_any": 1.0}}
    assert got["next_mean"] == pytest.approx(4 / 3)


def test_by_target_confidence_reads_the_confidence_of_each_position(signals):
    tables = [[0, 1, 4, 0, 6]]
    conf = [[float("nan"), 0.1, 0.95, 0.2, 0.999]]
    got = {(r["lo"], r["positions"]): r["accepted_mean"] for r in signals.by_target_confidence(tables, conf)}
    assert got == {(0.0, 2): 0.5, (0.9, 1): 4.0, (0.99, 1): 6.0}
