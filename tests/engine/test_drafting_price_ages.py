"""A drafting price that a burst of load inflated must not switch drafting off for good.

The measured cost model learns what drafting costs only from steps that draft, and the
draft-or-not choice drafts only where that price pays. So a price a burst of load inflated was
re-measured only by probes, which are paid at that price out of a slowly growing credit and
weighed one observation each against the burst's dozen: at in-domain c=1 on the embedded pair
the engine then drafted 11% of request-steps, against 68% without the burst
(benchmarks/adaptive/lockout.py). The drafting fit's evidence now ages with the engine's steps,
drafted or not (planner.cost.OnlineCostModel.observe), so evidence nothing renews fades towards
the start-up profile. The controls run the same steps with that ageing switched off, which is
the old behaviour, and must stay locked out.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_adaflash.engine.draft_choice import DraftChoice
from sglang_adaflash.planner import SurvivalPosterior
from sglang_adaflash.planner.cost import OnlineCostModel, StepCostModel, _Ridge

# one request on a CPU (what benchmarks/adaptive/lockout.py meets): a plain step 6 ms; a verify
# of L tokens 6 ms + 0.25 ms a token, plus 2 ms once it leaves the single-token path; drafting 4 ms,
# which the start-up profile put at 2 ms (it times a drafter forward alone, at its best of two)
A, C, W, DRAFT = 0.006, 0.00025, 0.002, 0.004
PROFILE = StepCostModel(fixed=A, per_token=C, per_draft=0.0005, draft_fixed=0.0015)
BURST, FACTOR = 12, 6.0  # drafted steps observed at FACTOR times the drafting price


def _price(model: OnlineCostModel) -> float:
    """What the drafting fit charges one drafted request (its forward and head, e + d)."""
    _, _, _, _, _, e, d, _ = model._clamped(model._parts(), 1)
    return e + d


def _warm(model: OnlineCostModel, steps: int = 64, factor: float = 1.0) -> None:
    for _ in range(steps):
        model.observe(1, 8, A + C * 8 + W, drafted=1, draft_seconds=factor * DRAFT, proposals=7)


@pytest.fixture(params=["ageing", "control"])
def ageing(request, monkeypatch):
    if request.param == "control":
        monkeypatch.setattr(_Ridge, "idle", lambda self: None)  # the old model: no step ages it
    return request.param == "ageing"


def test_an_inflated_drafting_price_fades_while_nothing_drafts(ageing):
    """After a burst at six times the price, 450 plain steps bring the drafting fit back within
    25% of the start-up profile's price; without ageing it stays above 2.5 times the true price."""
    model = OnlineCostModel(PROFILE)
    _warm(model)
    assert abs(_price(model) - DRAFT) < 0.05 * DRAFT
    _warm(model, BURST, FACTOR)
    assert _price(model) > 2.5 * DRAFT
    for _ in range(450):
        model.observe(1, 1, A + C, drafted=0)
    prior = PROFILE.draft_fixed + PROFILE.per_draft
    if ageing:
        assert abs(_price(model) - prior) < 0.25 * prior, _price(model)
    else:
        assert _price(model) > 2.5 * DRAFT, _price(model)


def test_a_fresh_measurement_outweighs_an_aged_burst(ageing):
    """One drafted step at the true price, 200 steps after the burst, brings the price back
    within 15% of it: the burst's evidence has aged and the new step's has not."""
    model = OnlineCostModel(PROFILE)
    _warm(model)
    _warm(model, BURST, FACTOR)
    for _ in range(199):
        model.observe(1, 1, A + C, drafted=0)
    _warm(model, 1)
    if ageing:
        assert abs(_price(model) - DRAFT) < 0.15 * DRAFT, _price(model)
    else:
        assert _price(model) > 2.5 * DRAFT, _price(model)


def test_steady_drafting_is_fitted_as_before():
    """While every step drafts, the ageing adds nothing: the fit equals one without it."""
    aged, plain = OnlineCostModel(PROFILE), OnlineCostModel(PROFILE)
    plain._draft.idle = lambda: None
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        jitter = float(torch.rand(1, generator=g)) * 0.001
        for m in (aged, plain):
            m.observe(1, 8, A + C * 8 + W + jitter, drafted=1, draft_seconds=DRAFT + jitter, proposals=7)
    assert aged.model(1) == plain.model(1)


def _simulate(steps: int, burst_at: int, factor: float = 10.0) -> list[bool]:
    """The engine's loop at one request, on a simulated machine where drafting pays at the true
    price (a row accepting 2 of 15 proposals a block: the rule drafts nearly every step) and not
    at the price BURST drafted steps at `factor` times it leave in the fit: the choice decides,
    the step is timed at the true price, the model and the probe credit are charged. Returns,
    per step, whether it drafted."""
    post = SurvivalPosterior(1)
    post.reset(torch.arange(1), ["code"])
    for _ in range(20):
        post.observe(torch.arange(1), torch.full((1,), 0.3), torch.tensor([2]), torch.full((1,), 16))
    choice = DraftChoice(post, 16, 2, "cpu")
    model = OnlineCostModel(PROFILE)
    seq = SimpleNamespace(since_draft=0, probe_gap=16)
    drafted_steps = []
    for step in range(steps):
        if step == burst_at:
            _warm(model, BURST, factor)
        drafted, _ = choice.choose([seq], [16], model.model(1), measured=True)
        length = int(choice.lengths[0]) if drafted and choice.lengths is not None else 1
        length = max(length, 2) if drafted else 1
        verify = A + C * length + (W if length > 1 else 0.0)
        draft = DRAFT if drafted else 0.0
        model.observe(1, length, verify, drafted=len(drafted), draft_seconds=draft if drafted else None,
                      proposals=length - 1)
        choice.charge_forced(SimpleNamespace(drafted=drafted, draft_seconds=draft, forced_catch_up_seconds=0.0),
                             length - 1, verify_seconds=verify)
        seq.since_draft = 0 if drafted else seq.since_draft + 1
        drafted_steps.append(bool(drafted))
    return drafted_steps


def test_drafting_comes_back_after_a_burst_of_load(ageing):
    """The closed loop: drafting nearly every step before the burst; within 500 steps of it, it
    drafts most steps again (the last 300: over 80%). Control: locked out (under 10%)."""
    drafted = _simulate(900, burst_at=100)
    assert sum(drafted[50:100]) >= 45  # drafting pays, and the rule drafts
    late = sum(drafted[600:]) / 300
    if ageing:
        assert late > 0.8, late
    else:
        assert late < 0.1, late


def test_idle_steps_age_the_evidence_exactly_as_observed_steps_do():
    """Each observation weighs decay ** (its age in steps, idle ones included), whether the idle
    steps are folded in by the next observation or every idle_fold steps: against the weighted
    least squares statistics computed directly."""
    g = np.random.default_rng(0)
    gaps = [0, 3, 0, 20, 5, 0, 40, 1, 15, 16, 2, 7]  # idle steps before each observation
    xs = [[1.0, float(g.integers(1, 9)), float(g.integers(1, 60))] for _ in gaps]
    ys = [float(g.uniform(0.001, 0.01)) for _ in gaps]
    ridge = _Ridge([0.001, 0.002, 0.0], (1.0, 64.0, 1024.0), 1e-3, 0.97, 1)
    at, step = [], 0
    for gap, x, y in zip(gaps, xs, ys):
        for _ in range(gap):
            ridge.idle()
        step += gap
        ridge.observe(x, y)
        at.append(step)
        step += 1
    scaled = np.array(xs) / np.array(ridge.scale)
    w = 0.97 ** (at[-1] - np.array(at))
    np.testing.assert_allclose(np.array(ridge.xtx).reshape(3, 3), (scaled * w[:, None]).T @ scaled, rtol=1e-9)
    np.testing.assert_allclose(ridge.xty, (scaled * w[:, None]).T @ np.array(ys), rtol=1e-9)
