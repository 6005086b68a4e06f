"""benchmarks/adaptive/foresight.py: the rule's foreseen step against the step it got.

Its summary is what a reader takes from it (the foreseen and realised gains over a plain step, and
the decisions against the oracle's table), so both are checked on steps written here with known
figures."""

from __future__ import annotations

import pytest

from sglang_adaflash.planner.lengths import PlanCost
from tests.bench.conftest import load_benchmark


@pytest.fixture(scope="module")
def foresight():
    return load_benchmark("adaptive/foresight.py")


def _step(bs, drafted, tokens, seconds, *, foreseen_tokens=None, foreseen=None, plain=0.010, rows=()):
    return {"bs": bs, "drafted": drafted, "forced": 0, "verified": bs, "tokens_foreseen": foreseen_tokens or tokens,
            "tokens": tokens, "seconds_foreseen": foreseen or seconds, "plain_foreseen": plain,
            "seconds": seconds, "draft_seconds": 0.0, "rows": list(rows)}


def test_gains_are_over_a_plain_step_foreseen_by_the_model_and_measured_by_ar(foresight):
    steps = [_step(2, 0, 2, 0.010), _step(2, 2, 6, 0.020, foreseen_tokens=8, foreseen=0.020, plain=0.016)]
    rows = {r["kind"]: r for r in foresight.summarise(steps, {2: [0.008, 0.010, 0.012]})}
    assert rows["plain"]["gain"] == pytest.approx((2 / 10) / (2 / 10))
    # foreseen: 8 tokens in 20 ms against 2 in the model's 16; realised: 6 in 20 against ar's median 10
    assert rows["planned"]["gain_foreseen"] == pytest.approx(3.2)
    assert rows["planned"]["gain"] == pytest.approx(1.5)


def test_decisions_against_the_oracles_table(foresight):
    # rows: [drafted, verify length, accepted, the table's accepted for a full block, cap]
    steps = [_step(3, 1, 5, 0.02, rows=[[0, 1, 0, 3, 16], [0, 1, 0, 0, 16], [1, 4, 2, 5, 16]]),
             _step(2, 1, 3, 0.02, rows=[[1, 3, 0, 0, 16], [0, 1, 0, 0, 1]])]  # a row with cap 1 is not a choice
    d = foresight.decisions(steps)
    assert d["plain_row_steps"] == 2 and d["plain_would_accept_share"] == 0.5 and d["plain_would_accept_mean"] == 1.5
    assert d["drafted_row_steps"] == 2 and d["drafted_accepting_nothing_share"] == 0.5
    assert d["drafted_cut_short_share"] == 0.5  # the first drafted row would have accepted 5, verified 3 proposals


def test_predicted_seconds_follow_the_planners_cost(foresight):
    cost = PlanCost(fixed=1.0, per_token=0.1, per_draft=0.5, draft_fixed=2.0, per_proposal=0.05)
    assert foresight.predicted_seconds(cost, [1, 1]) == pytest.approx(1.0 + 2 * 0.05)
    assert foresight.predicted_seconds(cost, [4, 1]) == pytest.approx(1.0 + 2.0 + 0.35 + 0.05 + 0.5)
