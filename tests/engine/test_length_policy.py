"""Verify lengths: always inside [min_len, B], and the load-aware rule shortens under load."""

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.drafter.length_head import AdaptiveLengthHead, candidate_lengths, length_label
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel, choose_verify_lengths, survival_rate


@pytest.mark.parametrize("block, rate, min_len", [(16, 1.3, 2), (8, 1.0, 1), (16, 2.0, 4)])
def test_paper_rule_bounds(block, rate, min_len):
    ratio = torch.rand(1000, generator=torch.Generator().manual_seed(block))
    ratio[:3] = torch.tensor([0.0, 1.0, 0.5])
    lengths = candidate_lengths(ratio, block, rate, min_len)
    assert lengths.min() >= min_len and lengths.max() <= block


@pytest.mark.parametrize("fixed", [10.0, 0.1, 0.001, 0.0])
def test_load_aware_rule_bounds(fixed):
    g = torch.Generator().manual_seed(1)
    for bs in (1, 7, 64):
        ratio = torch.rand(bs, generator=g)
        lengths = choose_verify_lengths(ratio, 16, StepCostModel(fixed, 0.001), min_len=2)
        assert lengths.min() >= 2 and lengths.max() <= 16


def test_load_aware_rule_respects_caps_and_load():
    ratio = torch.tensor([0.3, 0.6, 0.9])
    cap = torch.tensor([16, 3, 1])
    lengths = choose_verify_lengths(ratio, 16, StepCostModel(1.0, 0.001), min_len=2, max_len=cap)
    assert lengths.tolist()[1:] == [3, 1]
    light = choose_verify_lengths(ratio, 16, StepCostModel(1.0, 0.001), min_len=1)
    heavy = choose_verify_lengths(ratio, 16, StepCostModel(0.0, 0.001), min_len=1)
    assert (heavy <= light).all() and heavy.sum() < light.sum()
    # requests predicted to accept more get at least as many slots
    assert heavy.tolist() == sorted(heavy.tolist())


def test_survival_rate_matches_expected_tau():
    ratio = torch.tensor([0.1, 0.4, 0.8])
    a = survival_rate(ratio, 16)
    tau = (a[:, None] ** torch.arange(16)).sum(-1)
    assert torch.allclose(tau, ratio * 16, atol=1e-3)


def test_length_head_shapes_and_label():
    head = AdaptiveLengthHead(32, 64)
    ratio = head(torch.randn(5, 16, 32))
    assert ratio.shape == (5,) and ((ratio > 0) & (ratio < 1)).all()
    assert length_label(torch.tensor([0, 3, 15, 20]), 16).tolist() == [1 / 16, 4 / 16, 1.0, 1.0]


@pytest.mark.parametrize("lengths_from", ["history", "head"])
def test_engine_lengths_stay_in_bounds(target, drafter, lengths_from):
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=4, max_seq_len=64,
                     cost_model=StepCostModel(0.0, 0.001), lengths_from=lengths_from)
    outs = eng.run([Request([1, 2, 3 + i], SamplingParams(max_new_tokens=20)) for i in range(6)])
    min_len = drafter.config.length_head_min_len
    for o in outs:
        remaining = 19  # first token comes from prefill
        for v, a, d in zip(o.stats.verify_lens, o.stats.accept_lens, o.stats.drafted):
            # a request left undrafted verifies only its bonus token; a drafted one >= min_len
            assert v == 1 or min(min_len, remaining) <= v <= min(drafter.config.block_size, remaining)
            assert d or v == 1
            remaining -= a
        assert len(o.stats.predicted_ratios) == o.stats.steps == len(o.stats.drafted)
        # the head is read on every drafted step when it plans the lengths, never otherwise
        assert len(o.stats.head_ratios) == (sum(o.stats.drafted) if lengths_from == "head" else 0)


def test_online_cost_model_separates_batch_and_token_costs():
    """Steps timed as 2 ms + 0.5 ms per request + 0.1 ms per verified token: the fit recovers
    the per-token price instead of charging the per-request part to tokens."""
    from sglang_adaflash.planner.cost import OnlineCostModel

    model = OnlineCostModel(StepCostModel(fixed=0.01, per_token=0.001))
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        bs = int(torch.randint(1, 65, (1,), generator=g))
        tokens = bs * int(torch.randint(1, 17, (1,), generator=g))
        model.observe(bs, tokens, 0.002 + 0.0005 * bs + 0.0001 * tokens)
    fit = model.model(32)
    assert abs(fit.per_token - 0.0001) < 1e-5
    # every request was drafted, so the per-request price may sit in fixed or per_draft
    assert abs(fit.fixed + 32 * fit.per_draft + fit.draft_fixed - (0.002 + 0.0005 * 32)) < 1e-3


def test_the_fits_small_solver_matches_numpy_on_ridge_systems():
    """The online fit solves its 3 x 3 and 5 x 5 ridge systems in plain Python (_solve_small):
    the same solution as numpy's, on well- and badly-conditioned systems (features on scales
    from 1 to 1024, as the fit's are before scaling, and nearly collinear columns: a batch size
    that never changes), pivoting included."""
    import numpy as np

    from sglang_adaflash.planner.cost import _solve_small

    rng = np.random.default_rng(0)
    for k in (3, 5):
        for trial in range(100):
            x = rng.normal(size=(40, k)) * rng.choice([1.0, 64.0, 1024.0], size=k)
            if trial % 2:
                x[:, -1] = x[:, 0] * 3.0 + 1e-6 * rng.normal(size=40)  # nearly collinear
            a = x.T @ x + 1e-3 * np.eye(k)
            b = rng.normal(size=k)
            want = np.linalg.solve(a, b)
            got = np.asarray(_solve_small(a.tolist(), b.tolist()))
            # backward stable, as numpy's LU is: the residual is rounding-sized for the system
            scale = np.abs(a).max() * np.abs(got).max()
            assert np.abs(a @ got - b).max() <= 1e-12 * scale, (k, trial)
            assert np.abs(a @ want - b).max() <= 1e-12 * np.abs(a).max() * np.abs(want).max()
            if trial % 2 == 0:  # well-conditioned: the same solution
                assert np.allclose(got, want, rtol=1e-8, atol=1e-12 * np.abs(want).max()), (k, trial)
    # a zero in the leading pivot needs a row swap
    assert np.allclose(_solve_small([[0.0, 1.0], [1.0, 0.0]], [2.0, 3.0]), [3.0, 2.0])


def test_online_cost_model_prices_drafting_from_its_own_timings():
    """Verify phases timed as 2 ms + 0.5 ms per request + 0.1 ms per token, drafting as 1.5 ms +
    0.4 ms per drafted request, under a shared machine's jitter in the verify phase: the fit
    recovers the drafter's own price. Control: without the drafting phase's own timings the
    model cannot learn it (it keeps the profile's)."""
    from sglang_adaflash.planner.cost import OnlineCostModel

    prior = StepCostModel(fixed=0.01, per_token=0.001, per_draft=0.002, draft_fixed=0.01)
    split, whole = OnlineCostModel(prior), OnlineCostModel(prior)
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        bs = int(torch.randint(1, 65, (1,), generator=g))
        drafted = int(torch.randint(0, bs + 1, (1,), generator=g))
        proposals = int(torch.randint(drafted, 15 * drafted + 1, (1,), generator=g))
        tokens = bs + proposals
        verify = 0.002 + 0.0005 * bs + 0.0001 * tokens
        draft = (0.0015 + 0.0004 * drafted) if drafted else 0.0
        noise = float(torch.randn(1, generator=g)) * 0.0005  # a shared machine's jitter
        split.observe(bs, tokens, verify + noise, drafted=drafted, draft_seconds=draft, proposals=proposals)
        whole.observe(bs, tokens, verify + draft + noise, drafted=drafted)
    fit = split.model(32)
    assert abs(fit.draft_fixed - 0.0015) < 1e-4 and abs(fit.per_draft - 0.0004) < 1e-5, fit
    assert abs(fit.per_token - 0.0001) < 2e-5 and abs(fit.fixed - (0.002 + 0.0005 * 32)) < 1e-3, fit
    # control: drafting folded into the verify time is charged to the batch and the tokens
    bad = whole.model(32)
    assert abs(bad.draft_fixed - 0.0015) > 5e-4 or abs(bad.per_draft - 0.0004) > 1e-4, bad


def test_online_cost_model_keeps_up_with_a_cost_that_moves_while_it_is_asked_every_step():
    """The model is asked every step and its answer is cached between re-solves: when the
    machine slows down (every step doubles in price) the cached answer must follow within a
    re-solve, and its fit must equal a direct exponentially weighted ridge solve (numpy, the
    obvious reference) of the same observations. Control: the answer cached before the change
    is far from the truth afterwards."""
    import numpy as np

    from sglang_adaflash.planner.cost import OnlineCostModel

    prior = StepCostModel(fixed=0.01, per_token=0.001)
    model = OnlineCostModel(prior)
    g = torch.Generator().manual_seed(1)
    xs, ys = [], []
    before = None
    for step in range(600):
        slow = 2.0 if step >= 300 else 1.0
        bs = int(torch.randint(1, 65, (1,), generator=g))
        tokens = bs * int(torch.randint(1, 17, (1,), generator=g))
        seconds = slow * (0.002 + 0.0005 * bs + 0.0001 * tokens)
        model.observe(bs, tokens, seconds, drafted=0)
        xs.append([1.0, bs / 64.0, tokens / 1024.0])
        ys.append(seconds)
        fit = model.model(32)  # asked every step, as the engine does
        if step == 299:
            before = fit
    n = len(xs)
    w = np.array([0.97 ** (n - 1 - i) for i in range(n)])
    x, y = np.array(xs), np.array(ys)
    centre = np.array([prior.fixed, 0.0, prior.per_token * 1024.0])
    ridge = 1e-3 * np.eye(3)
    theta = np.linalg.solve((x * w[:, None]).T @ x + ridge, (x * w[:, None]).T @ y + ridge @ centre)
    a, b, c = theta / np.array([1.0, 64.0, 1024.0])
    # the last re-solve happened within refit_every (4) steps: close to the reference
    assert abs(fit.per_token - c) < 2e-6 and abs(fit.fixed - (a + b * 32)) < 2e-4, (fit, theta)
    truth = 2.0 * (0.002 + 0.0005 * 32)
    assert abs(fit.fixed - truth) < 0.1 * truth, fit
    assert abs(before.fixed - truth) > 0.3 * truth, before  # control: the stale answer is wrong


def test_the_engines_first_decode_step_is_not_fitted(target, drafter, monkeypatch):
    """The engine's first decode step pays one-time costs (buffers, first kernels at its
    shapes; 156 ms against 12 on the embedded pair): the online cost model never sees it, and
    sees every later step."""
    from sglang_adaflash.engine import engine as engine_mod
    from sglang_adaflash.planner.cost import OnlineCostModel

    seen = []
    real = OnlineCostModel.observe
    monkeypatch.setattr(OnlineCostModel, "observe", lambda self, *a, **k: (seen.append(a), real(self, *a, **k))[1])
    monkeypatch.setattr(engine_mod, "profile_step_cost", lambda e: StepCostModel(0.001, 0.0001))
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=2, max_seq_len=64)
    eng.run([Request([1, 2, 3 + i], SamplingParams(max_new_tokens=12)) for i in range(3)])
    assert eng.stats.steps > 3 and len(seen) == eng.stats.steps - 1, (len(seen), eng.stats.steps)


def test_predicted_ratios_are_the_planners_expected_tau():
    """The stats' predicted E[tau | L] / B per row (plain Python, every step) is the planner's
    expected_tau: checked on random rows against it, and 1/B on the rows not drafted."""
    from sglang_adaflash.engine.engine import SpecBatch
    from sglang_adaflash.planner.lengths import expected_tau

    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 17, (9,), generator=g)
    drafted = [0, 2, 3, 7]
    survival = torch.rand(4, generator=g)
    survival[1] = 1.0
    spec = SpecBatch(lengths, drafted=drafted, survival=survival)
    got = spec.predicted_ratios(16, True)
    want = [1 / 16] * 9
    for i, a in zip(drafted, survival):
        want[i] = float(expected_tau(a[None], lengths[i : i + 1])) / 16
    assert got == pytest.approx(want, rel=1e-5)
    assert SpecBatch(lengths).predicted_ratios(16, False) is None


def test_a_plain_step_is_priced_at_its_verify_time():
    """per_token is a proposal's price (the target's per token plus the drafter's LM head, g);
    a row's bonus token has no proposal, so a plain step must cost its fitted verify time
    a + b*n + c*n, not g*n more, and a drafted step its verify plus its drafting. (Charged g per
    row, a plain step at c=32 once looked twice its measured price and the rule drafted nearly
    every row, at 0.79x ar.)"""
    from sglang_adaflash.planner.cost import OnlineCostModel

    a, b, c, e, d, g_ = 0.004, 0.0004, 0.0001, 0.002, 0.0003, 0.0006
    model = OnlineCostModel(StepCostModel(fixed=0.01, per_token=0.001, per_draft=0.001, draft_fixed=0.001))
    g = torch.Generator().manual_seed(6)
    for _ in range(400):
        bs = int(torch.randint(1, 65, (1,), generator=g))
        drafted = int(torch.randint(0, bs + 1, (1,), generator=g))
        proposals = int(torch.randint(drafted, 8 * drafted + 1, (1,), generator=g))
        model.observe(bs, bs + proposals, a + b * bs + c * (bs + proposals), drafted=drafted,
                      draft_seconds=(e + d * drafted + g_ * proposals) if drafted else 0.0, proposals=proposals)
    n = 32
    fit = model.model(n)
    plain = fit.plain_step(n)
    assert abs(plain - (a + b * n + c * n)) < 0.05 * plain, (plain, a + b * n + c * n)
    # a step drafting every row with 3 proposals each: verify + drafting, as timed
    drafted_step = fit.fixed + fit.draft_fixed + fit.per_draft * n + (fit.per_token * 4 - fit.per_proposal) * n
    truth = a + b * n + c * 4 * n + e + d * n + g_ * 3 * n
    assert abs(drafted_step - truth) < 0.05 * truth, (drafted_step, truth)
