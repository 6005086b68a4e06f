"""An undrafted request's own evidence fades towards its domain's (SurvivalPosterior.idle).

A request's acceptance is only locally its own (the accepted count at one position correlates
0.13 with the count eight tokens on: benchmarks/adaptive/signals.py), but a request whose last
drafts failed kept that verdict for the rest of its output: while it drafts nothing only a probe
adds evidence. With the fade it drifts back to its domain's rate and drafts again where the
domain's rate pays, without a probe.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_adaflash.engine.draft_choice import DraftChoice
from sglang_adaflash.planner import SurvivalPosterior
from sglang_adaflash.planner.cost import StepCostModel


def _posterior(idle_decay: float, host: bool = True) -> SurvivalPosterior:
    """Four slots of one domain: slots 1-3 accept about half their proposals, slot 0 none."""
    post = SurvivalPosterior(4, idle_decay=idle_decay)
    post.host = host
    post.reset(torch.arange(4), ["code"] * 4)
    for _ in range(24):
        post.observe(torch.arange(1, 4), torch.full((3,), 0.5), torch.tensor([4, 3, 5]), torch.full((3,), 16))
        post.observe(torch.tensor([0]), torch.full((1,), 0.5), torch.tensor([0]), torch.full((1,), 16))
    return post


@pytest.mark.parametrize("host", [True, False])
def test_idle_fades_only_the_undrafted_rows_own_counts(host):
    post = _posterior(0.5, host)
    counts, domain = post.counts.clone(), post.domain_counts.clone()
    post.idle(3, drafted=[1])
    assert torch.allclose(post.counts[0], counts[0] * 0.5) and torch.allclose(post.counts[2], counts[2] * 0.5)
    assert torch.equal(post.counts[1], counts[1])  # drafted this step: its evidence is fresh
    assert torch.equal(post.counts[3], counts[3])  # not in the batch
    assert torch.equal(post.domain_counts, domain)  # the domain's evidence is not a request's


def test_a_faded_request_reads_its_domains_rate_and_no_fade_keeps_its_own():
    faded, kept = _posterior(0.8), _posterior(1.0)
    domain_only = _posterior(1.0)
    domain_only.counts[0] = 0  # slot 0 with its domain's evidence alone
    start = kept.estimate_on_host(1)[0][0]
    for _ in range(60):
        faded.idle(1, [])
        kept.idle(1, [])
    assert kept.estimate_on_host(1)[0][0] == start  # idle_decay = 1: nothing changes
    target = domain_only.estimate_on_host(1)[0][0]
    assert start < 0.5 * target
    assert faded.estimate_on_host(1)[0][0] == pytest.approx(target, rel=1e-3)


def test_idle_decay_must_be_a_fraction():
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="idle_decay"):
            SurvivalPosterior(2, idle_decay=bad)
    assert _posterior(0.9).fresh().idle_decay == 0.9


def _steps_until_drafted(idle_decay: float, steps: int) -> int | None:
    """A request whose own drafts all failed, alone in its batch, in a domain whose rate pays for
    drafting; no probe credit (probe_share 0): the step at which the choice drafts it again."""
    post = _posterior(idle_decay)
    choice = DraftChoice(post, 16, 2, "cpu", probe_share=0.0)
    # drafting costs about half a plain step: it pays at the domain's rate (0.71), not at the
    # request's own (0.31)
    cost = StepCostModel(fixed=0.01, per_token=0.0002, per_draft=0.0005, draft_fixed=0.005)
    seq = SimpleNamespace(since_draft=1, probe_gap=16)
    for step in range(steps):
        drafted, forced = choice.choose([seq], [16], cost, measured=False)
        if drafted:
            assert forced == []  # planned, not a probe or a first read
            return step
        post.idle(1, drafted)
        seq.since_draft += 1
    return None


def test_a_request_left_undrafted_drafts_again_once_its_failures_fade():
    """With the engine's fade the request drafts again within 40 steps of its last failure, by
    the plan alone; control: without the fade (idle_decay 1) it is never drafted in 200 steps."""
    assert _steps_until_drafted(1.0, 200) is None
    step = _steps_until_drafted(0.92, 40)
    assert step is not None and step > 0
    # the standing "draft nobody" plan is rechecked often enough for the fade to show
    assert _steps_until_drafted(0.5, 40) <= 9


def test_the_engine_fades_undrafted_rows_and_benchmarks_reset_with_the_same_settings(target, drafter):
    from sglang_adaflash.engine.engine import IDLE_DECAY, SpecEngine

    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=2, max_seq_len=64)
    assert eng.posterior.idle_decay == IDLE_DECAY < 1
    assert eng.posterior.fresh().idle_decay == IDLE_DECAY
    off = SpecEngine(target, drafter, mode="adaflash", max_batch_size=2, max_seq_len=64, idle_decay=1.0)
    assert off.posterior.idle_decay == 1.0
    assert np.isclose(IDLE_DECAY ** 8, 0.5, atol=0.05)  # about half after eight tokens, as documented


def test_every_step_fades_the_rows_it_did_not_draft(target, drafter):
    """The engine tells the posterior, after every decode step, which of its rows drafted."""
    from sglang_adaflash.core.sampling import SamplingParams
    from sglang_adaflash.engine.engine import SpecEngine
    from sglang_adaflash.engine.request import Request

    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=3, max_seq_len=96)
    calls = []
    post, record = eng.posterior, eng.posterior.idle

    def idle(n, drafted):
        calls.append((n, list(drafted)))
        record(n, drafted)

    post.idle = idle
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (8 + 3 * i,), generator=g).tolist() for i in range(4)]
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=24)) for p in prompts])
    assert all(o.error is None for o in outs)
    assert len(calls) == eng.stats.steps > 0
    assert all(0 < n <= 3 and all(0 <= i < n for i in d) for n, d in calls)
    # a drafted row verifies more than its bonus token: the rows named drafted are those
    verify_lens = [v for o in outs for v in o.stats.verify_lens]
    assert sum(len(d) for _, d in calls) == sum(1 for v in verify_lens if v > 1)
