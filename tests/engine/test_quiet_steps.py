"""A step that drafts nobody pays little more than a plain decoding step.

Where drafting does not pay (math on the shipped drafter), nearly every step drafts nobody, and
what the engine does between the target's forwards besides ar's own work is what adaflash loses
to `ar`. Three parts of it are kept off most such steps, each with the same outcome:
- the undrafted rows' fade (SurvivalPosterior.idle) is counted and folded in when the counts
  are next read;
- where not even the best evidence held could pay (DraftChoice.could_pay), the "draft nobody"
  plan stands as long as it does without the fade (the fade cannot make a row pay there);
- could_pay's answer is kept longer while the posterior gains no evidence.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_adaflash.engine import draft_choice
from sglang_adaflash.engine.draft_choice import DraftChoice
from sglang_adaflash.planner import SurvivalPosterior
from sglang_adaflash.planner.cost import StepCostModel

DECAY = 0.9


def _posterior(host: bool, accepted=(2, 3, 4, 5), idle_decay: float = DECAY) -> SurvivalPosterior:
    post = SurvivalPosterior(4, idle_decay=idle_decay)
    post.host = host
    post.reset(torch.arange(4), ["d"] * 4)
    for _ in range(6):
        post.observe(torch.arange(4), torch.full((4,), 0.5), torch.tensor(list(accepted)), torch.full((4,), 16))
    return post


@pytest.mark.parametrize("host", [True, False])
def test_the_fade_read_later_equals_the_fade_applied_every_step(host):
    """Steps of three rows, then two (a row retired), then one that drafts row 1, then three
    again: each row's counts fade once per step it was in the batch and not drafted, as the
    per-step multiply did, whenever they are read."""
    post = _posterior(host)
    start = post.counts.clone()
    for n, drafted, times in ((3, [], 5), (2, [], 4), (3, [1], 1), (3, [], 3)):
        for _ in range(times):
            post.idle(n, drafted)
    faded_steps = torch.tensor([5 + 4 + 1 + 3, 5 + 4 + 3, 5 + 1 + 3, 0], dtype=torch.float32)
    expected = start * (DECAY ** faded_steps)[:, None]
    assert torch.allclose(post.counts, expected, rtol=1e-5)
    # what reads the counts sees the fade too (estimate_on_host reads the storage as numpy)
    fresh = _posterior(host)
    fresh.counts[:] = expected
    assert np.allclose(post.estimate_on_host(4)[0], fresh.estimate_on_host(4)[0], rtol=1e-5)


def test_a_run_of_plain_steps_pays_one_multiply(monkeypatch):
    post = _posterior(True)
    folds = []
    fold = post._fold_idle
    monkeypatch.setattr(post, "_fold_idle", lambda: (folds.append(1), fold()))
    before = post._counts.clone()
    for _ in range(50):
        post.idle(4, [])
    assert torch.equal(post._counts, before) and folds == []  # nothing paid per step
    post.estimate_on_host(4)
    post.estimate_on_host(4)
    assert len(folds) == 1
    assert torch.allclose(post.counts, before * DECAY**50, rtol=1e-4)


# drafting costs more than a plain step here: no row of the posteriors below pays
DEAR = StepCostModel(fixed=0.005, per_token=0.0005, per_draft=0.002, draft_fixed=0.01)


def _plans(monkeypatch, steps: int, accepted) -> int:
    """Plans computed over `steps` steps of four undrafted rows with no probe credit."""
    choice = DraftChoice(_posterior(True, accepted), 16, 2, "cpu", probe_share=0.0)
    plans = []
    plan = choice._plan_on_host
    monkeypatch.setattr(choice, "_plan_on_host", lambda *a: (plans.append(1), plan(*a))[1])
    seqs = [SimpleNamespace(since_draft=1, probe_gap=16) for _ in range(4)]
    for _ in range(steps):
        drafted, _ = choice.choose(seqs, [16] * 4, DEAR, measured=False)
        assert drafted == []
        choice.posterior.idle(4, drafted)
        for s in seqs:
            s.since_draft += 1
    return len(plans)


def test_where_no_row_could_pay_the_nobody_plan_stands_as_without_the_fade(monkeypatch):
    """Rows that accept nothing, in a domain that accepts nothing: the plan is rechecked every
    QUIET_REPLAN + 1 steps, not every QUIET_FADING + 1. Control: the same batch with could_pay
    answering yes (the rule before) replans every QUIET_FADING + 1 steps."""
    steps = 33 * 10
    quiet = _plans(monkeypatch, steps, (0, 0, 0, 0))
    assert quiet <= steps // (draft_choice.QUIET_REPLAN + 1) + 1, quiet
    monkeypatch.setattr(DraftChoice, "could_pay", lambda self, bs, cost: True)
    fading = _plans(monkeypatch, steps, (0, 0, 0, 0))
    assert fading >= steps // (draft_choice.QUIET_FADING + 1), fading


def test_could_pay_is_kept_while_no_evidence_comes(monkeypatch):
    """Asked every step, could_pay is computed every MAX_PROBE_GAP * probe_every steps while the
    posterior gains no evidence, and every probe_every steps while it does (the control)."""
    calls = []
    could_pay = DraftChoice.could_pay
    monkeypatch.setattr(DraftChoice, "could_pay", lambda self, bs, cost: (calls.append(1), could_pay(self, bs, cost))[1])
    post = _posterior(True, (0, 0, 0, 0))
    choice = DraftChoice(post, 16, 2, "cpu", probe_every=16)
    for _ in range(640):
        assert choice._could_pay(4, DEAR) is False
    assert len(calls) == 640 // (draft_choice.MAX_PROBE_GAP * 16)
    calls.clear()
    for _ in range(640):
        choice._could_pay(4, DEAR)
        post.observe(torch.tensor([0]), torch.full((1,), 0.5), torch.tensor([0]), torch.full((1,), 16))
    assert len(calls) == 640 // 16


def _plans_with_joins(monkeypatch, join_domain: str, accepted=(0, 0, 0, 0), cost=DEAR, steps: int = 32) -> int:
    """Plans computed over `steps` steps of four undrafted rows where a request of `join_domain`
    takes row 3's slot every fourth step (one retires, one joins: the batch size stays)."""
    post = _posterior(True, accepted)
    choice = DraftChoice(post, 16, 2, "cpu", probe_share=0.0)
    plans = []
    plan = choice._plan_on_host
    monkeypatch.setattr(choice, "_plan_on_host", lambda *a: (plans.append(1), plan(*a))[1])
    seqs = [SimpleNamespace(since_draft=1, probe_gap=16) for _ in range(4)]
    for step in range(steps):
        if step % 4 == 3:
            post.reset(torch.tensor([3]), [join_domain])
            seqs[3] = SimpleNamespace(since_draft=0, probe_gap=0)
        drafted, _ = choice.choose(seqs, [16] * 4, cost, measured=False)
        choice.posterior.idle(4, drafted)
        for i, s in enumerate(seqs):
            s.since_draft = 0 if i in drafted else s.since_draft + 1
    return len(plans)


def test_a_join_where_no_row_could_pay_leaves_the_nobody_plan_standing(monkeypatch):
    """Joins of the batch's own domain, where no row could pay: the plan stands through them
    (rechecked every QUIET_REPLAN + 1 steps). Controls: a join of a domain with no evidence,
    where a drafter that is always right could pay, is planned (its first read; where not even
    that could pay, it is not), and so is every join where rows could pay."""
    assert _plans_with_joins(monkeypatch, "d", steps=64) <= 64 // (draft_choice.QUIET_REPLAN + 1) + 1
    # within one stand (QUIET_REPLAN steps), so that only the joins can make plans
    assert _plans_with_joins(monkeypatch, "d") == 1
    cheap = StepCostModel(fixed=0.05, per_token=0.0001, per_draft=0.0001, draft_fixed=0.0005)
    assert not DraftChoice(_posterior(True, (0, 0, 0, 0)), 16, 2, "cpu").could_pay(4, cheap)
    assert _plans_with_joins(monkeypatch, "new", cost=cheap) >= 32 // 4
    # ... but not where not even a drafter that is always right could pay: no first read then
    never = StepCostModel(fixed=0.001, per_token=0.001, per_draft=0.05, draft_fixed=0.05)
    assert not DraftChoice(_posterior(True, (0, 0, 0, 0)), 16, 2, "cpu").perfect_could_pay(4, never)
    assert _plans_with_joins(monkeypatch, "new", cost=never) == 1
    assert _plans_with_joins(monkeypatch, "d", accepted=(2, 3, 4, 14)) >= 32 // 4
