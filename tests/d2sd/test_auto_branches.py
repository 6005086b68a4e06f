"""`branch_drafter="auto"`: each step the load-aware rule prices the recovery drafter's branches
against the first drafter's next-ranked tokens and builds the better tree. Lossless either way
(T=0 equal to `ar` with joins; T>0 every position follows the target with both sources in one
run, control rejected); a dear recovery drafter is never run, a cheap one is, and each source's
acceptance is recorded where its branches were tried."""

import pytest

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.recovery import TreeCost
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.planner.cost import StepCostModel

from ..engine.test_lossless_sampling import NEW
from .conftest import OracleD2SD, assert_follows_target, recovery_for, sampling_models
from .test_d2sd_engine import _mixed_run, _prompts, _run
from .test_tree_verify import _no_residual_walk


def _priced(cls, recovery_cost):
    """cls with the recovery drafter's (per branch, fixed) seconds set instead of profiled;
    a callable gets the step number."""

    class Priced(cls):
        def _tree_cost_model(self, bs, rows):
            self._tree_cost = recovery_cost(self.tree_stats["steps"]) if callable(recovery_cost) else recovery_cost
            return super()._tree_cost_model(bs, rows)

    return Priced


@pytest.mark.parametrize("dear", [False, True])
def test_greedy_equals_ar_and_the_dear_drafter_is_not_run(target, drafter, monkeypatch, dear):
    """The oracle's first drafter ranks the right token second where it corrupts a slot, and its
    recovery drafter proposes the right continuation: both sources win branches. A recovery
    forward priced at 10 s a step is never worth running; at nothing it always is."""
    ran = []
    real = OracleD2SD._branch_logits

    def counted(self, *a, **kw):
        ran.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(OracleD2SD, "_branch_logits", counted)
    prompts = _prompts(7, seed=2)
    max_new = [9, 1, 17, 5, 12, 3, 20]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128), prompts, max_new)
    eng = _priced(OracleD2SD, (5.0, 10.0) if dear else (0.0, 0.0))(
        target, drafter, recovery_for(drafter), tree_k=3, branch_len=4, branch_width=2, branch_drafter="auto",
        max_batch_size=3, max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    assert _run(eng, prompts, max_new) == ar
    assert eng.tree_stats["branch_wins"] > 5, eng.tree_stats
    if dear:
        assert not ran and eng.tree_stats["first_drafter_steps"] == eng.tree_stats["planned_steps"] > 0
        assert eng._first_obs[0][1] > 0 and eng._alt_obs[0][1] == 0  # the first drafter's record moved only
    else:
        assert ran and eng.tree_stats["first_drafter_steps"] == 0
        assert eng._alt_obs[0][1] > 0 and eng._first_obs[0][1] == 0


def test_auto_needs_the_recovery_drafter_and_the_load_aware_rule(target, drafter):
    with pytest.raises(ValueError, match="recovery drafter"):
        D2SDEngine(target, drafter, None, branch_drafter="auto")
    with pytest.raises(ValueError, match="load_aware"):
        D2SDEngine(target, drafter, recovery_for(drafter), branch_drafter="auto", tree_rule="fixed")


@pytest.mark.parametrize("wrong", [False, True])
def test_every_position_follows_the_target_with_both_sources(wrong, monkeypatch):
    """The recovery drafter is free on even steps and dear on odd ones, so the run's trees come
    from both sources, greedy rows mixed in; control: a sampler that does not move to the
    residual after a rejected candidate is rejected."""
    if wrong:
        monkeypatch.setattr("sglang_adaflash.d2sd.engine.sampling_walk", _no_residual_walk)
    target, drafter, recovery = sampling_models()
    eng = _priced(D2SDEngine, lambda step: (0.0, 0.0) if step % 2 == 0 else (5.0, 10.0))(
        target, drafter, recovery, tree_k=2, branch_len=2, branch_width=2, branch_drafter="auto",
        max_batch_size=64, max_seq_len=32, seed=321, cost_model=StepCostModel(1.0, 1e-4))
    sp = SamplingParams(temperature=0.6, top_k=3, max_new_tokens=NEW)
    samples = _mixed_run(eng, sp)
    steps, first = eng.tree_stats["planned_steps"], eng.tree_stats["first_drafter_steps"]
    assert 0.3 * steps < first < 0.7 * steps, eng.tree_stats
    assert eng.tree_stats["branch_wins"] > 300, eng.tree_stats
    assert_follows_target(target, sp, samples, wrong)


def test_tree_cost_reaches_the_plan(target, drafter):
    """The recovery drafter's price is what the auto plan compares: TreeCost carries it."""
    eng = _priced(D2SDEngine, (1e-3, 2e-3))(target, drafter, recovery_for(drafter), branch_drafter="auto",
                                            max_batch_size=2, max_seq_len=64, cost_model=StepCostModel(1.0, 1e-4))
    cost = eng._tree_cost_model(2, [0, 1])
    assert isinstance(cost, TreeCost) and (cost.per_branch, cost.branch_fixed) == (1e-3, 2e-3)
