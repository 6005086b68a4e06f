"""benchmarks/adaptive/verdict.py: the median's order-statistic interval and each cell's verdict."""

from __future__ import annotations

import json
import math
import random

from tests.bench.conftest import load_benchmark

verdict = load_benchmark("adaptive/verdict.py")


def test_the_interval_is_the_narrowest_with_the_coverage_asked_for():
    xs = [float(i) for i in range(1, 9)]  # n = 8: [x2, x7] covers 0.930 < 0.95, so [x1, x8]
    lo, hi, cov = verdict.median_ci(xs, 0.95)
    assert (lo, hi) == (1.0, 8.0) and math.isclose(cov, 1 - 2 / 256)
    lo, hi, cov = verdict.median_ci(xs, 0.90)
    assert (lo, hi) == (2.0, 7.0) and math.isclose(cov, 1 - 2 * 9 / 256)
    lo, hi, cov = verdict.median_ci([float(i) for i in range(20, 0, -1)], 0.95)  # unsorted input
    assert (lo, hi) == (6.0, 15.0) and cov >= 0.95  # n = 20: ranks 6 and 15 (0.959)
    assert verdict.median_ci([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) is None  # [x1, x5] covers 0.9375


def test_the_interval_covers_the_true_median_as_often_as_it_says():
    """Seeded draws from a skewed distribution with a known median (1.0). Control: an interval
    two ranks narrower, which must fall short of the coverage."""
    rng = random.Random(0)
    trials, n = 3000, 16
    hit = narrow_hit = 0
    for _ in range(trials):
        xs = [math.exp(rng.gauss(0, 0.2)) ** 3 for _ in range(n)]  # median exp(0)^3 = 1
        lo, hi, cov = verdict.median_ci(xs, 0.95)
        hit += lo <= 1.0 <= hi
        s = sorted(xs)
        k = s.index(lo)
        narrow_hit += s[k + 2] <= 1.0 <= s[n - 3 - k]
    assert cov >= 0.95
    se = math.sqrt(0.95 * 0.05 / trials)
    assert hit / trials >= cov - 4 * se, hit / trials
    assert narrow_hit / trials < 0.95 - 4 * se, narrow_hit / trials  # the control is rejected


def test_verdicts():
    assert verdict.verdict((0.96, 1.10, 0.96), 0.95) == "met"
    assert verdict.verdict((0.80, 0.94, 0.96), 0.95) == "missed"
    assert verdict.verdict((0.90, 1.00, 0.96), 0.95) == "undecided"
    assert verdict.verdict(None, 0.95) == "too few pairs"


def _row(mode, workload, c, cpu, pairs=None):
    r = {"workload": workload, "concurrency": c, "mode": mode, "cpu_throughput_tok_s": cpu}
    if pairs is not None:
        r["paired_samples"] = pairs
    return r


def test_cells_pool_files_and_read_the_goal_against_the_faster_fixed_mode(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    pairs_a = [1.2, 1.1, 1.3, 1.0, 1.25, 1.15]
    pairs_b = [1.05, 1.2]
    a.write_text(json.dumps({"results": [
        _row("ar", "in_domain", 1, 100.0), _row("dflash", "in_domain", 1, 90.0),
        _row("adaflash", "in_domain", 1, 115.0, pairs_a),
        _row("ar", "math", 8, 100.0), _row("dflash", "math", 8, 125.0),  # dflash the faster here
        _row("adaflash", "math", 8, 120.0, [1.2] * 8)]}))
    b.write_text(json.dumps({"results": [
        _row("ar", "in_domain", 1, 100.0), _row("dflash", "in_domain", 1, 80.0),
        _row("adaflash", "in_domain", 1, 110.0, pairs_b)]}))
    rows = {(r["workload"], r["concurrency"]): r for r in verdict.table([a, b], 0.95, 0.95, 1.15)}
    c1 = rows[("in_domain", 1)]
    assert c1["pairs"] == 8 and c1["files"] == 2
    assert math.isclose(c1["median_vs_ar"], sorted(pairs_a + pairs_b)[3] / 2 + sorted(pairs_a + pairs_b)[4] / 2)
    assert c1["verdict_vs_best"] == "met" and c1["verdict_vs_ar"] == "undecided"  # [1.0, 1.3]
    m8 = rows[("math", 8)]
    assert math.isclose(m8["median_vs_best"], 1.2 * 100 / 125)  # 0.96 of dflash
    assert m8["verdict_vs_best"] == "met" and "verdict_vs_ar" not in m8
