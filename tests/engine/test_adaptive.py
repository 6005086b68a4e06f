"""The adaptive parts: the planner's optimality, online calibration, draft-off, probing and the
drafter context's lazy catch-up. Each check comes with a control that a wrong version fails."""

import functools
import itertools

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner import (
    PlanCost,
    SurvivalPosterior,
    expected_tau,
    plan_lengths,
)
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.planner.lengths import _plan_in_torch

from .conftest import OracleProposer
from .test_lossless_greedy import _prompts

# -- the planner ---------------------------------------------------------------------------


def _tau(a, lens) -> float:
    """E[tau | L] summed over requests, in float64, from one rate per request ([bs]) or one per
    proposal ([bs, B-1]): the planner's model written out independently of it."""
    total = 0.0
    for i, n in enumerate(torch.as_tensor(lens).tolist()):
        reach = 1.0
        for s in range(n):
            total += reach
            reach *= float(a[i]) if a.dim() == 1 else float(a[i, s]) if s < a.shape[1] else 0.0
    return total


def _value(a, lens, cost: PlanCost) -> float:
    lens = torch.as_tensor(lens)
    tokens = _tau(a, lens)
    drafted = lens > 1
    seconds = (cost.fixed + cost.draft_fixed * bool(drafted.any()) + cost.per_token * float(lens.sum())
               - cost.per_proposal * len(lens) + cost.per_draft * int(drafted.sum()))
    return tokens / seconds


def _best_by_enumeration(a, block, cost, min_len, cap, allow_off):
    options = []
    for i in range(len(a)):
        lo = min(min_len, int(cap[i]))
        opts = set(range(lo, int(cap[i]) + 1)) | ({1} if allow_off[i] else set())
        options.append(sorted(opts))
    return max(_value(a, combo, cost) for combo in itertools.product(*options))


def _cases(n, per_slot=False):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        bs = int(torch.randint(1, 4, (1,), generator=g))
        block = int(torch.randint(2, 6, (1,), generator=g))
        a = torch.rand(bs, generator=g) ** 2
        if per_slot:  # a rate per proposal, mostly falling along the block
            a = (a[:, None] * (1 - 0.5 * torch.rand(bs, block - 1, generator=g)).cumprod(1)).clamp(0, 1)
        per_token = 0.0005 + float(torch.rand(1, generator=g)) * 0.004
        cost = PlanCost(
            fixed=float(torch.rand(1, generator=g)) * 0.02,
            per_token=per_token,
            per_draft=float(torch.rand(1, generator=g)) * 0.01,
            draft_fixed=float(torch.rand(1, generator=g)) * 0.01,
            per_proposal=per_token * float(torch.rand(1, generator=g)) * 0.9,
        )
        min_len = int(torch.randint(1, 3, (1,), generator=g))
        cap = torch.randint(1, block + 1, (bs,), generator=g)
        allow_off = torch.rand(bs, generator=g) < 0.8
        yield a, block, cost, min_len, cap, allow_off


@pytest.mark.parametrize("path", ["host", "torch"])
@pytest.mark.parametrize("per_slot", [False, True], ids=["one_rate", "per_slot"])
def test_planner_is_optimal_by_brute_force(path, per_slot):
    """Both implementations (numpy on a CPU, torch's fixed rounds on an accelerator), with one
    survival rate per request and with a rate per proposal along the block."""
    plan = plan_lengths if path == "host" else functools.partial(_plan_in_torch, rounds=8)
    for a, block, cost, min_len, cap, allow_off in _cases(300, per_slot):
        if path == "host":
            lens = plan(a, block, cost, min_len=min_len, cap=cap, allow_off=allow_off)
        else:
            lens = plan(a, block, cost, min_len, cap, allow_off)
        lo = torch.minimum(torch.full_like(cap, min_len), cap)
        assert ((lens <= cap) & ((lens >= lo) | ((lens == 1) & allow_off))).all(), (lens, cap, allow_off)
        best = _best_by_enumeration(a, block, cost, min_len, cap, allow_off)
        assert _value(a, lens, cost) >= best * (1 - 1e-5), (a, cost, lens, best)


def test_brute_force_check_rejects_a_rule_blind_to_draft_costs():
    """Control: the rule without its draft-cost terms (the old slot-greedy rule) is caught."""
    caught = 0
    for a, block, cost, min_len, cap, allow_off in _cases(300):
        blind = plan_lengths(a, block, PlanCost(cost.fixed, cost.per_token), min_len=min_len, cap=cap,
                             allow_off=allow_off)
        best = _best_by_enumeration(a, block, cost, min_len, cap, allow_off)
        caught += _value(a, blind, cost) < best * (1 - 1e-5)
    assert caught > 10


def test_host_and_torch_plans_agree():
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        bs = int(torch.randint(1, 40, (1,), generator=g))
        a = torch.rand(bs, generator=g)
        if bool(torch.rand(1, generator=g) < 0.5):
            a = (a[:, None] * (1 - 0.4 * torch.rand(bs, 15, generator=g)).cumprod(1))
        cost = PlanCost(0.006, 0.0003 * float(torch.rand(1, generator=g)) + 1e-5,
                        0.001 * float(torch.rand(1, generator=g)), 0.003 * float(torch.rand(1, generator=g)))
        cap = torch.randint(1, 17, (bs,), generator=g)
        off = torch.rand(bs, generator=g) < 0.9
        host = plan_lengths(a, 16, cost, min_len=2, cap=cap, allow_off=off)
        dev = _plan_in_torch(a, 16, cost, 2, cap, off, 8)
        assert torch.equal(host, dev), (a, cost, host, dev)


def test_a_falling_profile_verifies_fewer_slots_than_one_rate_with_the_same_first_slot():
    """The point of a per-proposal rate: a tail the drafter rarely lands is not paid for."""
    cost = PlanCost(fixed=0.006, per_token=0.0004, per_draft=0.0005, draft_fixed=0.004)
    flat = plan_lengths(torch.tensor([0.7]), 16, cost, min_len=2)
    falling = plan_lengths(torch.tensor([[0.7, 0.63, 0.49, 0.45, 0.23, 0.14, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]]),
                           16, cost, min_len=2)
    same = plan_lengths(torch.full((1, 15), 0.7), 16, cost, min_len=2)
    assert torch.equal(same, flat)  # control: a flat profile is the one-rate plan
    assert 1 < int(falling) < int(flat), (falling, flat)


def test_planner_drafts_nobody_when_drafts_fail_and_everyone_when_they_succeed():
    cost = PlanCost(fixed=0.02, per_token=0.0005, per_draft=0.001, draft_fixed=0.002)
    assert plan_lengths(torch.full((8,), 0.02), 16, cost, min_len=2).tolist() == [1] * 8
    assert (plan_lengths(torch.full((8,), 0.9), 16, cost, min_len=2) > 1).all()
    mixed = plan_lengths(torch.tensor([0.02, 0.9, 0.02, 0.9]), 16, cost, min_len=2)
    assert mixed[0] == mixed[2] == 1 and mixed[1] > 2 and mixed[3] > 2


# -- calibration ---------------------------------------------------------------------------


def _simulate(post, slot, true_a, head_a, steps, block, g):
    """Verify whole blocks of a geometric process with survival true_a; the head says head_a."""
    slots = torch.tensor([slot])
    taus = []
    for _ in range(steps):
        n = 0
        while n < block - 1 and float(torch.rand(1, generator=g)) < true_a:
            n += 1
        taus.append(n + 1)
        post.observe(slots, torch.tensor([head_a]), torch.tensor([n]), torch.tensor([block]))
    return taus


def test_posterior_draws_centre_on_the_estimate_and_narrow_with_evidence():
    """Exploration's draws: their mean is the posterior mean the planner otherwise reads, and
    their spread shrinks as a request's record grows (a long run of failures is rarely retried).
    Control: the same failing request with a two-step record is not narrowed."""
    block, g = 16, torch.Generator().manual_seed(3)
    draws = torch.Generator().manual_seed(4)
    post = SurvivalPosterior(2, domain_weight=0.0)
    post.reset(torch.tensor([0, 1]), ["a", "b"])
    _simulate(post, 0, 0.5, 0.5, 2, block, g)  # thin evidence
    _simulate(post, 1, 0.02, 0.5, 40, block, g)  # a long record of failures
    slots = torch.tensor([0, 1])
    samples = torch.stack([post.sample(slots, draws) for _ in range(4000)])
    mean, _ = post.estimate(slots)
    assert torch.allclose(samples.mean(0), mean, atol=0.02), (samples.mean(0), mean)
    spread = samples.std(0)
    assert spread[1] < 0.5 * spread[0], spread
    assert float((samples[:, 1] > 0.5).float().mean()) < 0.01
    # control: the failing request with only two steps of record is not narrowed
    post.reset(torch.tensor([1]), ["b"])
    _simulate(post, 1, 0.02, 0.5, 2, block, g)
    short = torch.stack([post.sample(slots, draws) for _ in range(4000)]).std(0)
    assert not short[1] < 0.5 * short[0], short


def _chain(profile, g) -> int:
    """Proposals accepted in one verified block whose proposal j survives with profile[j]."""
    n = 0
    while n < len(profile) and float(torch.rand(1, generator=g)) < profile[n]:
        n += 1
    return n


@pytest.mark.parametrize("falling", [True, False], ids=["falling", "control_flat"])
def test_the_domain_profile_follows_acceptance_along_the_block(falling):
    """A drafter's later proposals are accepted less often once reached: the per-proposal rates
    the planner reads fall along the block as the verified blocks did. Control: a geometric
    process (one rate everywhere) keeps the profile flat, the rate as the posterior's."""
    block, g = 16, torch.Generator().manual_seed(5)
    profile = ([0.75, 0.65, 0.5, 0.45, 0.25, 0.15] + [0.1] * 9) if falling else [0.6] * 15
    post = SurvivalPosterior(2)
    post.reset(torch.tensor([0, 1]), ["code", "code"])
    for step in range(600):
        slot = torch.tensor([step % 2])
        post.observe(slot, torch.tensor([0.5]), torch.tensor([_chain(profile, g)]), torch.tensor([block]))
    rate, _ = post.estimate(torch.tensor([0]))
    rates = post.per_slot(torch.tensor([0]), rate, block - 1)[0]
    if falling:
        assert rates[0] > 0.65 and rates[4] < 0.35 and rates[0] > 1.8 * rates[4], rates
    else:
        assert torch.allclose(rates[:5], rate.expand(5), atol=0.06), (rates, rate)
    # a domain with no evidence yet reads the request's rate at every slot
    post.reset(torch.tensor([1]), ["prose"])
    fresh = post.per_slot(torch.tensor([1]), torch.tensor([0.4]), block - 1)
    assert torch.allclose(fresh, torch.full((1, block - 1), 0.4))
    post.forget()
    assert torch.allclose(post.per_slot(torch.tensor([0]), torch.tensor([0.4]), block - 1),
                          torch.full((1, block - 1), 0.4))


@pytest.mark.parametrize("true_a, head_a", [(0.05, 0.75), (0.8, 0.4), (0.5, 0.5)])
def test_calibration_follows_the_requests_history(true_a, head_a):
    block, g = 16, torch.Generator().manual_seed(1)
    post = SurvivalPosterior(4)
    post.reset(torch.tensor([0]), ["math"])
    slot = torch.tensor([0])
    assert torch.allclose(post.calibrate(slot, torch.tensor([head_a])), torch.tensor([head_a]), atol=1e-4)
    _simulate(post, 0, true_a, head_a, 64, block, g)
    taus = _simulate(post, 0, true_a, head_a, 200, block, torch.Generator().manual_seed(2))
    cal = post.calibrate(slot, torch.tensor([head_a]))
    predicted = float(expected_tau(cal, torch.tensor([block]))) / block
    actual = sum(taus) / len(taus) / block
    raw = float(expected_tau(torch.tensor([head_a]), torch.tensor([block]))) / block
    assert abs(predicted - actual) < 0.05 + 0.25 * actual, (predicted, actual)
    if abs(true_a - head_a) > 0.2:  # control: the uncalibrated head is this far off
        assert abs(raw - actual) > 0.1
    # a step the head rates higher stays higher after calibration
    lo, hi = post.calibrate(slot.repeat(2), torch.tensor([head_a * 0.8, min(head_a * 1.2, 0.99)]))
    assert hi > lo


def test_a_new_request_starts_from_its_domains_history():
    post = SurvivalPosterior(4)
    post.reset(torch.tensor([0, 1]), ["math", "code"])
    g = torch.Generator().manual_seed(3)
    _simulate(post, 0, 0.02, 0.75, 40, 16, g)
    post.reset(torch.tensor([0, 2]), ["math", "math"])  # two fresh math requests
    rate, known = post.estimate(torch.tensor([0, 1, 2]))
    assert known.tolist() == [True, False, True]  # the code request has no history yet
    assert rate[0] < 0.2 and rate[2] < 0.2
    post.move(2, 3)
    assert torch.allclose(post.estimate(torch.tensor([3]))[0], rate[2:3])


# -- draft-off in the engine ---------------------------------------------------------------

DEAR_DRAFTS = StepCostModel(fixed=0.01, per_token=0.001, per_draft=0.004, draft_fixed=0.004)


def _engine(target, drafter, proposer=None, **kw):
    kw.setdefault("cost_model", DEAR_DRAFTS)
    return SpecEngine(target, drafter, mode="adaflash", max_batch_size=3, max_seq_len=160, proposer=proposer, **kw)


def _ar(target, prompts, max_new):
    eng = SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=160)
    return [o.output_ids for o in eng.run([Request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts])]


def test_failing_drafts_are_switched_off_losslessly(target, drafter):
    """A random drafter accepts ~nothing: after its first reads a request is drafted only on
    probes, verifies only its bonus token otherwise, and the output is still exactly ar's."""
    prompts = _prompts(5, seed=13)
    ar = _ar(target, prompts, 40)
    eng = _engine(target, drafter, probe_every=4, probe_share=1.0)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=40)) for p in prompts])
    assert [o.output_ids for o in outs] == ar
    drafted = [d for o in outs for d in o.stats.drafted]
    assert sum(drafted) < 0.4 * len(drafted)
    for o in outs:
        st = o.stats
        assert all(v == 1 for v, d in zip(st.verify_lens, st.drafted) if not d)
        later = st.drafted[8:]
        assert any(later), "probes must keep drafting now and then"
    # control: with draft-off disabled every step drafts
    always = _engine(target, drafter, draft_off=False).run([Request(p, SamplingParams(max_new_tokens=40)) for p in prompts])
    assert [o.output_ids for o in always] == ar
    assert all(all(o.stats.drafted[:-1]) for o in always)  # the last token cannot be drafted


def test_a_fresh_posterior_is_the_one_the_draft_choice_reads(target, drafter):
    """Resetting calibration by assigning a fresh posterior (benchmarks/adaptive/run.py does it
    before every timed run) must reach the draft-or-not choice: drafts that failed before the
    reset and succeed after it are drafted again, from the new evidence alone. With the choice
    holding a reference of its own, it kept deciding from the frozen "failing" evidence."""
    prompts = _prompts(3, seed=21)
    ar = _ar(target, prompts, 40)
    eng = _engine(target, drafter, proposer=OracleProposer(target, drafter, error_rate=1.0),
                  probe_every=4, probe_share=1.0)
    first = eng.run([Request(p, SamplingParams(max_new_tokens=40), domain="d") for p in prompts])
    assert sum(d for o in first for d in o.stats.drafted) < 0.4 * sum(len(o.stats.drafted) for o in first)
    eng.posterior = SurvivalPosterior(eng.max_batch_size)
    eng.proposer = OracleProposer(target, drafter, error_rate=0.0)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=40), domain="d") for p in prompts])
    assert [o.output_ids for o in outs] == ar
    drafted = [d for o in outs for d in o.stats.drafted]
    assert sum(drafted) > 0.7 * len(drafted), f"drafted {sum(drafted)} of {len(drafted)} steps"


def test_a_draft_off_engine_refuses_to_lose_its_posterior(target, drafter):
    eng = _engine(target, drafter)
    with pytest.raises(ValueError, match="fresh SurvivalPosterior"):
        eng.posterior = None
    assert eng.choice.posterior is not None


@pytest.mark.parametrize("backoff", [True, False])
def test_probes_that_accept_nothing_back_off(target, drafter, backoff, monkeypatch):
    """A request whose reads accept nothing waits 8, then 16 steps (probe_every 4: the gap
    doubles from it after each failed probe, up to 4 * probe_every) for its next probe.
    Control (backoff=False: the gap never grows): probes every 4 steps, told apart."""
    from sglang_adaflash.engine.draft_choice import DraftChoice

    if not backoff:
        monkeypatch.setattr(DraftChoice, "next_probe_gap", lambda self, gap, accepted_nothing: self.probe_every)
    prompt = _prompts(1, seed=29)
    eng = _engine(target, drafter, probe_every=4, probe_share=1.0)
    (out,) = eng.run([Request(prompt[0], SamplingParams(max_new_tokens=60))])
    st = out.stats
    drafted = [k for k, d in enumerate(st.drafted) if d]
    assert len(drafted) >= 4 and all(st.accept_lens[k] == 1 for k in drafted[:4]), drafted
    waits = [b - a - 1 for a, b in zip(drafted, drafted[1:])][:3]  # undrafted steps between
    assert waits == ([8, 16, 16] if backoff else [4, 4, 4]), drafted


@pytest.mark.parametrize("limit", [None, 100])
def test_a_cold_wave_of_one_domain_reads_the_drafter_four_times_not_once_each(target, drafter, limit, monkeypatch):
    """Twelve new requests of one domain with a drafter that accepts nothing: the first step
    drafts at most four of them, the second drafts none (they start from the domain's
    evidence), and the output is still ar's. Control (limit=100, every cold request reads):
    all twelve draft in the first step."""
    import sglang_adaflash.engine.draft_choice as draft_choice

    if limit is not None:
        monkeypatch.setattr(draft_choice, "FIRST_READS", limit)
    prompts = _prompts(12, seed=23)
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=12, max_seq_len=160,
                     cost_model=DEAR_DRAFTS, probe_share=0.0)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=12), domain="math") for p in prompts])
    ar = SpecEngine(target, None, mode="ar", max_batch_size=12, max_seq_len=160).run(
        [Request(p, SamplingParams(max_new_tokens=12)) for p in prompts])
    assert [o.output_ids for o in outs] == [o.output_ids for o in ar]
    first = sum(o.stats.drafted[0] for o in outs)
    second = sum(o.stats.drafted[1] for o in outs)
    if limit is None:
        assert 1 <= first <= 4 and second == 0, (first, second)
    else:
        assert first == 12, first


class _WakingProposer(OracleProposer):
    """Wrong on every proposal until a request has `wake` output tokens, exact afterwards."""

    def __init__(self, *a, prompt_len, wake, **k):
        super().__init__(*a, error_rate=0.0, **k)
        self.prompt_len, self.wake = prompt_len, wake

    def propose(self, last, ctx_lens, histories, slots=None, read=None):
        states = super().propose(last, ctx_lens, histories, slots, read=read)
        for i, hist in enumerate(histories):
            if len(hist) - self.prompt_len < self.wake:
                self._props[i] = (self._props[i] + 1) % self.target.vocab_size
        return states


def test_probing_notices_a_request_that_starts_accepting(target, drafter):
    prompt = _prompts(1, seed=17)[0]
    prop = _WakingProposer(target, drafter, prompt_len=len(prompt), wake=30)
    eng = _engine(target, drafter, proposer=prop, probe_every=4, probe_share=1.0)
    out = eng.run([Request(prompt, SamplingParams(max_new_tokens=110))])[0]
    assert out.output_ids == _ar(target, [prompt], 110)[0]
    st = out.stats
    produced = [1 + sum(st.accept_lens[:k]) for k in range(st.steps)]
    asleep = [d for d, n in zip(st.drafted, produced) if 8 < n < 30]
    awake = [(d, a) for d, a, n in zip(st.drafted, st.accept_lens, produced) if n >= 30 + 4 * 4 * 2]
    assert sum(asleep) < len(asleep) / 2, "wrong drafts must be switched off"
    assert awake and all(d for d, _ in awake) and sum(a for _, a in awake) > 3 * len(awake), awake


def _head_ratio_on_fresh_context(target, drafter, ids):
    """The head's ratio for the block after `ids`, the drafter context built in one prefill."""
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=1, max_seq_len=160,
                     cost_model=StepCostModel(0.01, 0.001), calibrate=False, draft_off=False)
    return eng.run([Request(ids, SamplingParams(max_new_tokens=3))])[0].stats.head_ratios[0]


@pytest.mark.parametrize("broken", [False, True])
def test_drafter_context_catches_up_after_draft_off(target, drafter, broken, monkeypatch):
    """After steps without drafting, the drafter sees exactly the context it would have seen had
    it been fed every step (checked through the head, against a context built by prefill).
    Control (broken=True): skipping the catch-up is detected."""
    if broken:
        def forget(self, seqs, rows, uncommitted=0):  # drops the backlog instead of feeding it to the drafter
            for i in rows:
                seqs[i].pending = 0

        monkeypatch.setattr(SpecEngine, "_catch_up", forget)
    prompts = _prompts(2, seed=19)
    # read through the head's reading of every drafted block (the catch-up is the same code
    # whichever source plans the lengths)
    eng = _engine(target, drafter, probe_every=3, probe_share=1.0, lengths_from="head")
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=30)) for p in prompts])
    checked, differ = 0, 0
    for p, o in zip(prompts, outs):
        st, ratios = o.stats, iter(o.stats.head_ratios)
        for k, d in enumerate(st.drafted):
            if not d:
                continue
            r = next(ratios)
            if k == 0 or st.drafted[k - 1]:
                continue  # only steps right after undrafted ones needed a catch-up
            j = sum(st.accept_lens[:k])  # output tokens whose K/V were committed before step k
            ref = _head_ratio_on_fresh_context(target, drafter, p + o.output_ids[:j])
            checked += 1
            differ += abs(ref - r) > 1e-6
    assert checked >= 3
    assert (differ > 0) == broken


@pytest.mark.parametrize("share", [0.05, 0.3])
def test_probing_spends_at_most_its_share(target, drafter, share):
    """Probes of requests whose drafts fail are paid from a credit of `share` of the plain steps'
    cost: what they spend (drafter forwards and probe rows, priced by the cost model) stays
    within it. Control: probing whenever due (share 1.0) overspends the 0.05 budget."""
    def spent(eng_share):
        prompts = _prompts(3, seed=23)
        eng = _engine(target, drafter, probe_every=2, probe_share=eng_share)
        outs = eng.run([Request(p, SamplingParams(max_new_tokens=60)) for p in prompts])
        c, bs, first = DEAR_DRAFTS, 3, 1  # every request is read once at step 0 (no history)
        row = c.per_draft + c.per_token * (drafter.config.length_head_min_len - 1)
        steps = min(o.stats.steps for o in outs)
        probe_steps = [k for k in range(first, steps) if any(o.stats.drafted[k] for o in outs)]
        rows = sum(o.stats.drafted[k] for o in outs for k in probe_steps)
        return (c.draft_fixed * len(probe_steps) + row * rows) / (steps * (c.fixed + c.per_token * bs)), rows

    fraction, rows = spent(share)
    assert rows > 0, "probes must still happen"
    assert fraction <= share * 1.05, fraction
    eager, _ = spent(1.0)
    assert eager > 0.05 * 1.05, eager


def test_forced_drafting_is_charged_what_it_measured(target, drafter):
    """With the online cost model, a step that drafted only forced rows pays its measured
    drafting time (and its proposals' verify slots) less what the plan took; a step where
    forced rows rode along pays their measured catch-up; the debt is bounded."""
    from sglang_adaflash.engine.engine import SpecBatch

    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=4, max_seq_len=64, seed=0)
    assert eng.cost_model is None  # measured prices
    choice = eng.choice
    charge = choice.charge_forced
    spec = SpecBatch(torch.ones(2, dtype=torch.long), drafted=[0], probes=[0], draft_seconds=0.010)
    choice.credit, choice.forced_charge = 0.020, (0.004, 0.001, 1.0, 0.030)
    charge(spec, proposals=3)
    assert choice.credit == pytest.approx(0.020 - (0.010 + 0.003 - 0.004))
    assert choice.forced_charge is None
    # the measured verify phase: a step that verified 8 ms beyond a plain step's 30 ms pays
    # those 8 ms, not its 3 slots' 3 ms; one within the plain price pays its slots
    for verify_seconds, charged in ((0.038, 0.008), (0.031, 0.003)):
        choice.credit, choice.forced_charge = 0.020, (0.004, 0.001, 1.0, 0.030)
        charge(spec, proposals=3, verify_seconds=verify_seconds)
        assert choice.credit == pytest.approx(0.020 - (0.010 + charged - 0.004))
    choice.credit = 0.011
    ride = SpecBatch(torch.ones(2, dtype=torch.long), drafted=[0, 1], probes=[1],
                     draft_seconds=0.05, forced_catch_up_seconds=0.002)
    charge(ride, proposals=9)
    assert choice.credit == pytest.approx(0.011 - 0.002)
    choice.forced_charge = (0.0, 0.0, 0.05, 0.0)
    charge(SpecBatch(torch.ones(1, dtype=torch.long), drafted=[0], draft_seconds=9.0), 1)
    assert choice.credit == -0.05  # bounded debt


def test_a_lazy_prompt_context_equals_the_eager_one(target, drafter, monkeypatch):
    """Under draft-off a new request's prompt features wait for its first draft. Once caught up,
    the drafter's context of every request equals that of an engine that projected the prompt
    at prefill, position by position (a wrong context would only lower acceptance, which no
    T=0 equality test can see). Requests join at different steps, of different lengths."""
    import sglang_adaflash.engine.engine as engine_mod

    def contexts(lazy: bool):
        if not lazy:
            monkeypatch.setattr(engine_mod, "_LAZY_PROMPT_ELEMENTS", 0)
        eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=5, max_seq_len=160,
                         cost_model=DEAR_DRAFTS, probe_every=3)
        prompts = _prompts(5, seed=31)
        for i, p in enumerate(prompts[:3]):
            eng.submit(Request(p, SamplingParams(max_new_tokens=40), f"r{i}", "math"))
        for step in range(12):
            if step == 4:
                for i, p in enumerate(prompts[3:], 3):
                    eng.submit(Request(p, SamplingParams(max_new_tokens=40), f"r{i}", "math"))
            eng.step()
        lazy_rows = sum(s.prompt_feats is not None for s in eng.running)
        eng._catch_up(eng.running, list(range(len(eng.running))))
        cache = eng.proposer.cache
        out = {}
        for i, s in enumerate(eng.running):
            out[s.req.request_id] = [cache.view(layer, 1, s.cache_len, offset=i)
                                     for layer in range(len(cache.k))]
        monkeypatch.undo()
        return out, lazy_rows

    lazy, waiting = contexts(True)
    eager, none_waiting = contexts(False)
    assert waiting > 0 and none_waiting == 0, "some prompt must still have been waiting"
    assert lazy.keys() == eager.keys() and len(lazy) >= 3
    for rid in lazy:
        for (lk, lv), (ek, ev) in zip(lazy[rid], eager[rid]):
            assert torch.allclose(lk, ek, atol=1e-6) and torch.allclose(lv, ev, atol=1e-6), rid


@pytest.mark.parametrize("lengths_from", ["history", "head"])
def test_history_planned_steps_draft_only_the_slots_they_verify(target, drafter, lengths_from, monkeypatch):
    """With lengths planned from history, each drafter forward computes the query side of the
    block slots 1..max(L)-1 the step verifies and nothing else (the head's steps read the whole
    block: the control), the LM head runs on the verified slots alone, and the output is ar's."""
    from sglang_adaflash.engine.proposer import DFlashProposer

    reads, heads = [], []
    propose = DFlashProposer.propose
    proposal_logits = DFlashProposer.proposal_logits

    def spy(self, last, ctx, histories=None, slots=None, read=None):
        n = len(last)  # a slice reads the same slots of every row
        reads.append(None if read is None else [list(range(read.stop))[read]] * n if isinstance(read, slice)
                     else read.tolist())
        return propose(self, last, ctx, histories, slots=slots, read=read)

    def spy_logits(self, hidden, rows, slots):
        heads.append(len(slots))
        return proposal_logits(self, hidden, rows, slots)

    monkeypatch.setattr(DFlashProposer, "propose", spy)
    monkeypatch.setattr(DFlashProposer, "proposal_logits", spy_logits)
    verified = []
    commit = SpecEngine._commit

    def spy_commit(self, seqs, spec, committed, result):
        if spec.drafted:
            verified.append([int(spec.lengths[i]) for i in spec.drafted])
        return commit(self, seqs, spec, committed, result)

    monkeypatch.setattr(SpecEngine, "_commit", spy_commit)
    prompts = _prompts(4, seed=17)
    cheap = StepCostModel(fixed=0.01, per_token=1e-4, per_draft=1e-4, draft_fixed=1e-4)  # drafting pays
    eng = _engine(target, drafter, cost_model=cheap, lengths_from=lengths_from, probe_every=2, probe_share=1.0)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=24)) for p in prompts])
    assert [o.output_ids for o in outs] == _ar(target, prompts, 24)
    assert len(reads) == len(verified) > 5
    for read, lens in zip(reads, verified):
        if lengths_from == "head":
            assert read is None  # the whole block: the length head reads it
            continue
        width = max(lens) - 1
        assert read == [list(range(1, width + 1))] * len(lens)
    assert sum(heads) == sum(n - 1 for lens in verified for n in lens)  # proposals only where verified


def _switched_off_engine(target, drafter, prompts, max_new=60):
    """An engine whose rows (one domain) drafted first and are switched off now, probes off."""
    eng = _engine(target, drafter, probe_every=64, probe_share=0.0)
    for p in prompts:
        eng.submit(Request(p, SamplingParams(max_new_tokens=max_new)))
    for _ in range(20):
        eng.step()
    assert not any(seq.since_draft == 0 for seq in eng.running), "drafts must be switched off by now"
    assert all(seq.prompt_feats is None for seq in eng.running), "each row must have drafted once"
    return eng


def test_a_swapped_drafter_is_read_afresh(target, drafter):
    """After drafts failed long enough to be switched off, a hot-reloaded drafter must not
    inherit that verdict: drafter_swapped() drops the evidence, and the next request of that
    domain reads the new drafter (a first read). Control: without the swap it is not drafted."""
    prompts = _prompts(3, seed=29)

    def new_request_drafted(swap: bool) -> bool:
        eng = _switched_off_engine(target, drafter, prompts[:2])
        if swap:
            eng.drafter_swapped()
        eng.submit(Request(prompts[2], SamplingParams(max_new_tokens=20)))
        for _ in range(3):  # admission and prefill, then its first decode steps
            eng.step()
        new = [seq for seq in eng.running if seq.req.prompt_ids == prompts[2]]
        return any(new[0].stats.drafted)

    assert new_request_drafted(swap=True)
    assert not new_request_drafted(swap=False)


def test_rows_in_flight_at_a_swap_finish_plain_and_leave_no_evidence(target, drafter):
    """A row whose prompt the old version projected into the drafter's cache drafts no more
    after a swap: the new version's drafts there would read the old version's keys and values,
    and being the domain's first evidence, their failures switched a good version off for a
    domain (the closed-loop demo's math, 35 requests). So after the swap those rows verify only
    their bonus token, the forgotten evidence stays empty while only they run, the output is
    still ar's, and a row that had not read the drafter yet drafts as usual (first read)."""
    prompts = _prompts(3, seed=31)
    ar = _ar(target, prompts, 60)
    eng = _switched_off_engine(target, drafter, prompts[:2])
    eng.drafter_swapped()
    stale = {id(seq) for seq in eng.running}
    steps_before = {id(seq): len(seq.stats.drafted) for seq in eng.running}
    for _ in range(5):
        eng.step()
    assert float(eng.posterior.domain_counts.abs().sum()) == 0.0, "stale rows must leave no evidence"
    eng.submit(Request(prompts[2], SamplingParams(max_new_tokens=60)))
    outs = {}
    while eng.has_unfinished():
        for seq in list(eng.running):
            if id(seq) in stale:
                assert seq.stale_context
                assert not any(seq.stats.drafted[steps_before[id(seq)]:]), "a stale row drafted"
        for out in eng.step():
            outs[tuple(out.prompt_ids) if hasattr(out, "prompt_ids") else len(outs)] = out
    by_prompt = {tuple(o.output_ids): o for o in outs.values()}
    assert sorted(by_prompt) == sorted(tuple(a) for a in ar)
    fresh = [o for o in outs.values() if list(o.output_ids) == ar[2]]
    assert fresh and fresh[0].stats.drafted[0], "a row that joins after the swap reads the new drafter"


def test_the_host_choice_equals_the_tensor_choice():
    """On a CPU the draft-or-not choice plans in numpy on views of the posterior; it must decide
    exactly as the tensor path (what an accelerator runs) over random states: the same rows, the
    same forced rows, the same lengths and rates."""
    from types import SimpleNamespace

    import numpy as np

    from sglang_adaflash.engine.draft_choice import DraftChoice

    g = torch.Generator().manual_seed(11)
    decided = 0
    for trial in range(150):
        bs = int(torch.randint(1, 24, (1,), generator=g))
        post = SurvivalPosterior(bs)
        post.reset(torch.arange(bs), [f"d{int(i)}" for i in torch.randint(0, 3, (bs,), generator=g)])
        for _ in range(int(torch.randint(0, 30, (1,), generator=g))):
            rows = torch.randperm(bs, generator=g)[: int(torch.randint(1, bs + 1, (1,), generator=g))]
            lens = torch.randint(1, 17, (len(rows),), generator=g)
            acc = (torch.rand(len(rows), generator=g) * lens).long().clamp(max=lens - 1)
            post.observe(rows, torch.rand(len(rows), generator=g), acc, lens)
        seqs = [SimpleNamespace(since_draft=int(torch.randint(0, 40, (1,), generator=g)), probe_gap=16)
                for _ in range(bs)]
        caps = torch.randint(1, 17, (bs,), generator=g).tolist()
        cost = StepCostModel(fixed=0.01 * float(torch.rand(1, generator=g)), per_token=1e-4 + 1e-3 * float(torch.rand(1, generator=g)),
                             per_draft=1e-3 * float(torch.rand(1, generator=g)), draft_fixed=5e-3 * float(torch.rand(1, generator=g)))
        out = []
        for host in (True, False):
            choice = DraftChoice(post, 16, 2, "cpu", probe_share=1.0)
            choice.host = host
            chosen, forced = choice.choose(seqs, caps, cost, measured=True)
            out.append((chosen, forced, choice.lengths.tolist(), choice.rate.numpy().copy()))
        assert out[0][:3] == out[1][:3], (trial, out)
        np.testing.assert_allclose(out[0][3], out[1][3], rtol=1e-6)
        decided += bool(out[0][0])
    assert 30 < decided < 150  # control: the cases draft some rows, and not always


def test_the_host_update_equals_the_tensor_update():
    """observe() on a CPU updates the posterior in numpy on views of its tensors; the state it
    leaves is the tensor path's, over a random run of steps with shared domains and rows that
    verified no proposal."""
    g = torch.Generator().manual_seed(12)
    a, b = SurvivalPosterior(9), SurvivalPosterior(9)
    b.host = False
    domains = [f"d{int(i)}" for i in torch.randint(0, 3, (9,), generator=g)]
    for p in (a, b):
        p.reset(torch.arange(9), domains)
    for _ in range(300):
        rows = torch.randperm(9, generator=g)[: int(torch.randint(1, 10, (1,), generator=g))]
        lens = torch.randint(1, 17, (len(rows),), generator=g)
        acc = (torch.rand(len(rows), generator=g) * lens).long().clamp(max=lens - 1)
        head = torch.rand(len(rows), generator=g)
        for p in (a, b):
            p.observe(rows, head, acc, lens)
    for name in ("counts", "domain_counts", "slot_counts"):
        assert torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6), name
    assert float(a.slot_counts.sum()) > 0 and float(a.counts.abs().sum()) > 0
    assert (a.observed == b.observed).all() and a.observed[1:4].all()  # the three domains, shown live
