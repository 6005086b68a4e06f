"""What drafting on and off costs, priced as it is: probes where no row could pay, and catch-up.

Two ways the draft-or-not choice used to pay for drafting it did not get:
- probes at batch sizes where not even rows as good as the best evidence held would pay drafted
  (at mixed c=64 on the embedded pair they and their catch-up took about 3% of a run that drafted
  nothing);
- a row drafted again after steps off first projects the context it queued meanwhile, and the
  drafting fit priced that as drafting: on-and-off drafting looked dearer than steady drafting,
  and at in-domain c=4 the rule, once off, stayed mostly off.
"""

import time
from types import SimpleNamespace

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine import draft_choice
from sglang_adaflash.engine.draft_choice import DraftChoice
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner import SurvivalPosterior
from sglang_adaflash.planner.cost import OnlineCostModel, StepCostModel

from .test_lossless_greedy import _prompts

# a step that a batch's size dominates (compute-bound verify): a verified token costs what it costs
TOKEN_BOUND = StepCostModel(fixed=0.0005, per_token=0.001, per_draft=0.0005, draft_fixed=0.001)
# a step its fixed part dominates (one request, memory-bound): proposals are nearly free
FIXED_BOUND = StepCostModel(fixed=0.02, per_token=0.0002, per_draft=0.0005, draft_fixed=0.001)


def _posterior(bs: int, accepted: list[int], block: int = 16) -> SurvivalPosterior:
    """Every row of domain "d" with a history of accepting accepted[i] of block - 1 proposals."""
    post = SurvivalPosterior(bs)
    post.reset(torch.arange(bs), ["d"] * bs)
    for _ in range(20):
        post.observe(torch.arange(bs), torch.full((bs,), 0.5), torch.tensor(accepted), torch.full((bs,), block))
    return post


def test_could_pay_reads_the_best_evidence_and_the_step_cost():
    """A batch whose best row accepts nearly whole blocks could pay where a step's fixed part
    dominates, not where every verified token costs its full share; a batch whose rows all
    accept nothing could not pay at either, and one with no evidence at all is not ruled out."""
    good = DraftChoice(_posterior(8, [0] * 7 + [14]), 16, 2, "cpu")
    assert good.could_pay(8, FIXED_BOUND)
    assert not good.could_pay(8, TOKEN_BOUND)
    bad = DraftChoice(_posterior(8, [0] * 8), 16, 2, "cpu")
    assert not bad.could_pay(8, FIXED_BOUND)
    assert not bad.could_pay(8, TOKEN_BOUND)
    # the batch size prices it: a good row pays alone where a step's fixed part is most of it,
    # not in a batch of 64, where every row's verified tokens are
    mid = StepCostModel(fixed=0.01, per_token=0.0005, per_draft=0.0005, draft_fixed=0.001)
    wide = DraftChoice(_posterior(64, [14] + [0] * 63), 16, 2, "cpu")
    assert wide.could_pay(1, mid)
    assert not wide.could_pay(64, mid)
    # a row with no history, in a domain with none, is no evidence: only the step's price rules
    # drafting out, where not even a drafter that is always right would pay
    cold = SurvivalPosterior(64)
    cold.reset(torch.arange(64), ["new"] * 64)
    assert DraftChoice(cold, 16, 2, "cpu").could_pay(4, TOKEN_BOUND)
    assert not DraftChoice(cold, 16, 2, "cpu").could_pay(64, DEAR_ROWS)


def test_a_lone_failing_row_is_no_long_shot_where_another_domain_pays():
    """At c=1 the batch's best row is the row itself: a request whose last blocks failed must
    still get its full probes where the drafter has shown, on another domain, acceptance that
    would pay at this batch size (the bound is the best evidence held, not the batch's).
    Control: with no domain but its own, the same failing row is a long shot."""
    post = _posterior(4, [14] * 4)  # domain "d" pays
    post.reset(torch.tensor([0]), ["other"])
    for _ in range(20):
        post.observe(torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0]), torch.tensor([16]))
    assert DraftChoice(post, 16, 2, "cpu").could_pay(1, FIXED_BOUND)
    alone = _posterior(1, [0])
    assert not DraftChoice(alone, 16, 2, "cpu").could_pay(1, FIXED_BOUND)


# a drafted row costs more than its verified tokens save in a batch of 64, even accepting whole
# blocks (in-domain c=32 and c=64 on the embedded pair, as fitted: benchmarks/adaptive/README.md)
DEAR_ROWS = StepCostModel(fixed=0.012, per_token=0.0003, per_draft=0.003, draft_fixed=0.007)


def test_cold_rows_read_the_drafter_only_where_a_perfect_drafter_could_pay():
    """Eight cold rows of one domain: FIRST_READS of them read the drafter where whole accepted
    blocks would pay (a batch of 8 at DEAR_ROWS' prices); none where not even those would (a
    batch of 64: the step's price alone rules drafting out, and a read cannot change the plan).
    Control: the same 64 with the old rule (first reads whatever the price) read FIRST_READS."""
    def forced(bs: int, perfect: bool | None = None) -> int:
        post = SurvivalPosterior(bs)
        post.reset(torch.arange(bs), ["d"] * bs)
        choice = DraftChoice(post, 16, 2, "cpu", probe_share=0.0)
        if perfect is not None:
            choice.perfect_could_pay = lambda bs, cost: perfect
        seqs = [SimpleNamespace(since_draft=0, probe_gap=16) for _ in range(bs)]
        drafted, probes = choice.choose(seqs, [16] * bs, DEAR_ROWS, measured=False)
        assert drafted == probes
        return len(probes)

    assert forced(8) == draft_choice.FIRST_READS
    assert forced(64) == 0
    assert forced(64, perfect=True) == draft_choice.FIRST_READS


# one request, a plain step's fixed part large (c=1): drafting pays from a survival near 0.5
ONE_ROW = StepCostModel(fixed=0.006, per_token=0.0004, per_draft=0.003, draft_fixed=0.002)


def _domain_of_requests(rates: list[float], seed: int = 0) -> SurvivalPosterior:
    """Requests of one domain "d" in cache slots 0.., 60 blocks of 5 proposals each, request i's
    proposals surviving with rates[i]."""
    g = torch.Generator().manual_seed(seed)
    post = SurvivalPosterior(len(rates))
    post.reset(torch.arange(len(rates)), ["d"] * len(rates))
    for _ in range(60):
        accepted = []
        for rate in rates:
            n = 0
            while n < 5 and float(torch.rand(1, generator=g)) < rate:
                n += 1
            accepted.append(n)
        post.observe(torch.arange(len(rates)), torch.full((len(rates),), 0.5), torch.tensor(accepted),
                     torch.full((len(rates),), 6))
    return post


def test_the_long_shot_bound_is_the_best_evidence_itself():
    """One row at c=1, priced by ONE_ROW, breaks even near a survival of 0.5: a domain accepting
    50-60% could pay and keeps its full probes, one accepting 40% or less is a long shot. The
    bound is the evidence as it stands, with no optimism added (a margin of 1 in log-odds, which
    made 0.3-0.4 pay, cost 2-3% at mixed c=8 once a hot reload's rows in flight no longer spoiled
    the new version's evidence). The same domains in a batch of 8 cannot pay at all: each row
    adds its verify tokens to a step whose fixed price no longer dominates."""
    for rate, expected in ((0.1, False), (0.3, False), (0.4, False), (0.5, True), (0.6, True)):
        assert DraftChoice(_domain_of_requests([rate]), 16, 2, "cpu").could_pay(1, ONE_ROW) == expected, rate
    for rate in (0.5, 0.7):
        assert not DraftChoice(_domain_of_requests([rate] * 8), 16, 2, "cpu").could_pay(8, ONE_ROW), rate


def test_a_request_above_its_domain_is_its_own_bound():
    """A request of a domain accepting 70% in a batch of its own, while seven others of its
    domain accepted 5%: its own rate, not the domain's, bounds the long shot, and it keeps its
    probes. Control: one of the 5% requests in a batch of its own is a long shot."""
    assert DraftChoice(_domain_of_requests([0.7] + [0.05] * 7), 16, 2, "cpu").could_pay(1, ONE_ROW)
    assert not DraftChoice(_domain_of_requests([0.05] * 7 + [0.7]), 16, 2, "cpu").could_pay(1, ONE_ROW)


def _probes(choice: DraftChoice, bs: int, cost: StepCostModel, steps: int) -> int:
    """Rows drafted over `steps` steps where every row's drafts fail (each probe finds nothing)."""
    seqs = [SimpleNamespace(since_draft=0, probe_gap=choice.probe_every) for _ in range(bs)]
    caps = [16] * bs
    forced = 0
    for _ in range(steps):
        drafted, probes = choice.choose(seqs, caps, cost, measured=False)
        assert drafted == probes  # nothing here is drafted for its own sake
        forced += len(probes)
        for i, s in enumerate(seqs):
            if i in drafted:
                s.probe_gap, s.since_draft = choice.next_probe_gap(s.probe_gap, True), 0
            else:
                s.since_draft += 1
    return forced


@pytest.mark.parametrize("cost", [TOKEN_BOUND, FIXED_BOUND])
def test_where_no_row_could_pay_probes_get_a_quarter_of_their_credit(cost, monkeypatch):
    """16 rows that accept nothing, 2,000 steps: probes still run (a request that starts
    accepting is still noticed), on about LONG_SHOT_SHARE of the credit they get where a row
    could pay. Control: with the full share where no row could pay (the old choice), the same
    batch probes at least three times as often."""
    post = _posterior(16, [0] * 16)
    long_shot = _probes(DraftChoice(post, 16, 2, "cpu", probe_every=4), 16, cost, 2000)
    monkeypatch.setattr(draft_choice, "LONG_SHOT_SHARE", 1.0)
    full = _probes(DraftChoice(post, 16, 2, "cpu", probe_every=4), 16, cost, 2000)
    assert long_shot > 0
    assert 3 * long_shot <= full, (long_shot, full)


def test_the_drafting_fit_does_not_see_a_rows_backlog_catch_up(target, drafter, monkeypatch):
    """Draft-off with a measured cost model and a drafter that accepts nothing: rows are drafted
    on probes only, each after steps off, so each first projects its queued backlog into the
    drafter's context. That projection is made to take 50 ms more here; the drafting fit must
    not see it (a drafted step's drafting is otherwise about 2 ms on this pair; 10 ms, the first
    margin, was once crossed on a loaded machine), while the step's own drafting time does.
    Control: the engine's drafting time includes the catch-ups."""
    slow = 0.05
    catching_up = [False]
    drafting = [False]  # inside a drafted step's drafting (the catch-ups a step's drafting time holds)

    def flagged(flag, method):
        def wrapped(*args, **kwargs):
            flag[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                flag[0] = False
        return wrapped

    fitted: list[float] = []
    observe = OnlineCostModel.observe

    def spy(self, batch_size, tokens, seconds, drafted=None, draft_seconds=None, proposals=None, **rest):
        if drafted and draft_seconds is not None:
            fitted.append(draft_seconds)
        return observe(self, batch_size, tokens, seconds, drafted, draft_seconds, proposals, **rest)

    monkeypatch.setattr(SpecEngine, "_catch_up", flagged(catching_up, SpecEngine._catch_up))
    monkeypatch.setattr(SpecEngine, "_catch_up_drafted", flagged(drafting, SpecEngine._catch_up_drafted))
    monkeypatch.setattr(OnlineCostModel, "observe", spy)
    monkeypatch.setattr(draft_choice, "LONG_SHOT_SHARE", 1.0)  # probes as often as the credit allows
    monkeypatch.setattr("sglang_adaflash.engine.engine.profile_step_cost", lambda eng: FIXED_BOUND)
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=3, max_seq_len=240, probe_every=4,
                     probe_share=1.0, cost_model=None)
    extend = eng.proposer.extend_context
    backlogs = [0, 0]  # all, and those caught up inside a drafted step's drafting

    def slow_backlog(feats, starts, slots):
        if catching_up[0] and int(starts.min()) > 0:  # a backlog (a prompt's context starts at 0)
            backlogs[0] += 1
            backlogs[1] += drafting[0]
            time.sleep(slow)
        return extend(feats, starts, slots)

    eng.proposer.extend_context = slow_backlog
    eng.run([Request(p, SamplingParams(max_new_tokens=120)) for p in _prompts(3, seed=13)])
    assert backlogs[1] >= 5 and len(fitted) >= 5, (backlogs, fitted)
    assert max(fitted) < slow, fitted
    # the catch-ups did run inside the steps' drafting (a full queue is also flushed outside it,
    # in a plain step, which is why only those inside are counted)
    assert eng.stats.draft_seconds > backlogs[1] * slow, (eng.stats.draft_seconds, backlogs)
