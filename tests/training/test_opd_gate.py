"""The gate: paired bootstrap over the held-out prompts, the mean's lower bound, a per-domain floor.

Rows are what the evaluation records per prompt: [key, domain, committed tokens, decode steps].
"""

from __future__ import annotations

import random

import pytest

from training_job.opd.gate import GateConfig, decide


def _rows(taus: dict[str, list[float]], steps: int = 20) -> list[list]:
    """One row per prompt with the given tau (tokens = tau * steps)."""
    return [[f"{d}-{i}", d, round(t * steps), steps] for d, ts in taus.items()
            for i, t in enumerate(ts)]


def _noisy(rng, mean: float, n: int, spread: float = 0.6) -> list[float]:
    return [max(1.0, rng.gauss(mean, spread)) for _ in range(n)]


def test_a_tie_does_not_pass():
    """Identical numbers are no gain: the lower bound of a zero gain is not above zero."""
    same = _rows({"math": [2.0, 2.5, 3.0, 2.2], "code": [1.5, 1.8, 1.6, 1.7]})
    d = decide(same, same, GateConfig())
    assert not d["passed"] and d["reason"] == "NoGain" and d["gain"] == 0.0


def test_a_clear_gain_everywhere_passes():
    rng = random.Random(0)
    parent = {"math": _noisy(rng, 2.0, 24), "code": _noisy(rng, 1.8, 24)}
    cand = {"math": [t + 1.0 for t in parent["math"]], "code": [t + 0.1 for t in parent["code"]]}
    d = decide(_rows(cand), _rows(parent), GateConfig())
    assert d["passed"] and d["reason"] == "Passed", d["message"]
    assert d["gainLow"] > 0 and not any(v["dropped"] for v in d["domains"].values())


def test_the_floor_fails_a_domain_that_drops_beyond_its_noise():
    """Math gains a lot, code loses a little on every prompt: the mean passes, the floor does
    not (the mean over domains alone would have published this)."""
    rng = random.Random(1)
    parent = {"math": _noisy(rng, 2.0, 16), "code": _noisy(rng, 2.2, 16)}
    cand = {"math": [t + 1.5 for t in parent["math"]], "code": [t - 0.1 for t in parent["code"]]}
    d = decide(_rows(cand), _rows(parent), GateConfig())
    assert d["gainLow"] > 0  # the mean alone would pass
    assert not d["passed"] and d["reason"] == "DomainDrop"
    code = d["domains"]["code"]
    assert code["dropped"] and code["delta"] < 0 and code["delta"] + code["noise"] < 0
    assert "code" in d["message"] and not d["domains"]["math"]["dropped"]


def test_a_drop_within_the_noise_is_not_a_failure():
    """Code moves down on average but up on some prompts, by as much as it moves down."""
    rng = random.Random(2)
    parent = {"math": _noisy(rng, 2.0, 12), "code": _noisy(rng, 2.0, 12)}
    cand = {"math": [t + 1.0 for t in parent["math"]],
            "code": [t + rng.choice((-0.5, 0.4)) for t in parent["code"]]}
    d = decide(_rows(cand), _rows(parent), GateConfig())
    assert d["domains"]["code"]["delta"] < 0 and not d["domains"]["code"]["dropped"]
    assert d["passed"], d["message"]


def test_small_domains_are_reported_not_floored():
    rng = random.Random(3)
    parent = {"math": _noisy(rng, 2.0, 16), "prose": [2.0, 2.0, 2.0]}
    cand = {"math": [t + 1.0 for t in parent["math"]], "prose": [1.5, 1.5, 1.5]}
    d = decide(_rows(cand), _rows(parent), GateConfig(min_domain_prompts=4))
    assert d["domains"]["prose"] == {"prompts": 3, "delta": -0.5, "noise": 0.0,
                                     "floored": False, "dropped": False}
    assert decide(_rows(cand), _rows(parent), GateConfig(min_domain_prompts=3))["reason"] == \
        "DomainDrop"


def test_min_gain_asks_for_a_gain_beyond_the_noise():
    rng = random.Random(4)
    parent = {"math": _noisy(rng, 2.0, 32)}
    cand = {"math": [t * 1.05 for t in parent["math"]]}
    assert decide(_rows(cand), _rows(parent), GateConfig(min_gain=0.0))["passed"]
    d = decide(_rows(cand), _rows(parent), GateConfig(min_gain=0.10))
    assert not d["passed"] and d["reason"] == "NoGain"


def test_the_decision_is_reproducible_and_only_paired_prompts_count():
    rng = random.Random(5)
    parent = _rows({"math": _noisy(rng, 2.0, 10)})
    cand = _rows({"math": _noisy(rng, 2.3, 10)}) + [["extra", "math", 99, 1]]
    a, b = decide(cand, parent, GateConfig()), decide(cand, parent, GateConfig())
    assert a == b and a["prompts"] == 10
    assert decide([], parent, GateConfig())["reason"] == "NoEvaluation"


@pytest.mark.parametrize("bad", [dict(confidence=1.0), dict(confidence=float("nan")),
                                 dict(resamples=10), dict(min_gain=float("inf")),
                                 dict(min_domain_prompts=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        GateConfig(**bad)


def test_the_false_pass_rate_of_a_null_candidate_is_about_one_minus_the_confidence():
    """Statistical check with its control. Each round: prompts of varied difficulty; the
    candidate's tau on a prompt is the parent's plus noise. With no gain (the control) it
    passes in about 5% of rounds at 95%; with a real 10% gain almost always."""
    rng = random.Random(6)
    null_passes = gain_passes = 0
    trials = 200
    for _ in range(trials):
        parent = {"math": _noisy(rng, 2.5, 20), "code": _noisy(rng, 2.0, 20)}
        null = {d: [max(1.0, t + rng.gauss(0, 0.3)) for t in v] for d, v in parent.items()}
        better = {d: [max(1.0, 1.1 * t + rng.gauss(0, 0.3)) for t in v]
                  for d, v in parent.items()}
        cfg = GateConfig(resamples=400, seed=rng.randrange(1000))
        null_passes += decide(_rows(null), _rows(parent), cfg)["passed"]
        gain_passes += decide(_rows(better), _rows(parent), cfg)["passed"]
    assert null_passes / trials <= 0.10, null_passes
    assert gain_passes / trials >= 0.90, gain_passes
