"""A drafter version's own eval (its manifest's tau per domain) as the calibration's prior.

Without it every cold engine, and every engine that just swapped a version in, read the
drafter for its first rows of each domain before the plan had anything to price them by; where
drafting cannot pay at the batch size those reads were most of what it drafted (planner.prior).
"""

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine import draft_choice
from sglang_adaflash.engine.draft_choice import DraftChoice
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner import SurvivalPosterior, expected_tau
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.planner.prior import acceptance_prior, survival_from_tau

from .test_lossless_greedy import _prompts

# one request, a plain step's fixed part large (c=1): drafting pays from a survival near 0.5
ONE_ROW = StepCostModel(fixed=0.006, per_token=0.0004, per_draft=0.003, draft_fixed=0.002)


@pytest.mark.parametrize("tau", [1.0, 1.14, 2.8, 3.45, 9.0, 15.9])
def test_the_prior_rate_gives_back_the_evals_tau(tau):
    a = survival_from_tau(tau, 16)
    assert 0.0 <= a < 1.0
    got = float(expected_tau(torch.tensor([a]), torch.tensor([16]))[0])
    assert got == pytest.approx(tau, abs=0.02)


def test_a_manifest_without_a_usable_eval_gives_no_prior():
    """Bad eval values are skipped (the prior only saves first reads; a version must not fail to
    serve over its eval's bookkeeping), the rest are kept."""
    assert acceptance_prior(None, 16) == {}
    assert acceptance_prior({"eval": {}}, 16) == {}
    assert acceptance_prior({"eval": {"tau_by_domain": "3.0"}}, 16) == {}
    got = acceptance_prior({"eval": {"tau_by_domain": {
        "code": 3.45, "nan": math.nan, "low": 0.5, "high": 17.0, "text": "3", "flag": True,
        "int": 2}}}, 16)
    assert set(got) == {"code", "int"}
    assert got["code"] == pytest.approx(survival_from_tau(3.45, 16))
    # requests that carried no domain: the eval's "untagged", the calibration's None pool
    untagged = acceptance_prior({"eval": {"tau_by_domain": {"untagged": 2.0}}}, 16)
    assert set(untagged) == {None}
    post = SurvivalPosterior(1)
    post.set_prior(untagged)
    post.reset(torch.arange(1), [None])
    assert post.estimate(torch.arange(1))[1].tolist() == [True]


def test_the_untagged_name_is_the_traffic_readers():
    from sglang_adaflash.planner.prior import UNTAGGED
    from training_job.opd.traffic import UNTAGGED as TRAFFIC_UNTAGGED

    assert UNTAGGED == TRAFFIC_UNTAGGED


def test_the_prior_starts_its_domains_and_survives_a_cold_start():
    """A row of a domain the eval names is known from its first step at the eval's rate; a row of
    another domain is cold. fresh() (a benchmark's cold start) keeps the prior, forget(prior)
    replaces it (a new version's eval), forget() drops it. The head's reading of a drafted block
    is left as it is (calibrate's offset is zero with the prior alone)."""
    rates = acceptance_prior({"eval": {"tau_by_domain": {"code": 3.45, "math": 1.14}}}, 16)
    post = SurvivalPosterior(3)
    post.set_prior(rates)
    post.reset(torch.arange(3), ["code", "math", "other"])
    rate, known = post.estimate(torch.arange(3))
    assert known.tolist() == [True, True, False]
    assert rate[:2].tolist() == pytest.approx([rates["code"], rates["math"]], abs=1e-4)
    host_rate, host_known = post.estimate_on_host(3)
    assert host_known.tolist() == [True, True, False]
    assert host_rate[:2].tolist() == pytest.approx(rate[:2].tolist(), abs=1e-6)
    head = torch.tensor([0.3, 0.9, 0.5])
    assert post.calibrate(torch.arange(3), head).tolist() == pytest.approx(head.tolist(), abs=1e-4)

    cold = post.fresh()
    cold.reset(torch.arange(3), ["code", "math", "other"])
    assert cold.estimate(torch.arange(3))[1].tolist() == [True, True, False]
    post.forget({"other": 0.5})
    assert post.estimate(torch.arange(3))[1].tolist() == [False, False, True]
    post.forget()
    assert not post.estimate(torch.arange(3))[1].any() and post.prior == {}


def test_live_evidence_outweighs_a_flattering_prior():
    """The prior is a few pseudo-trials: a domain whose eval said 3.45 but whose requests accept
    nothing is rated by what they do within ten verify steps."""
    post = SurvivalPosterior(2)
    post.set_prior(acceptance_prior({"eval": {"tau_by_domain": {"code": 3.45}}}, 16))
    post.reset(torch.arange(2), ["code", "code"])
    for _ in range(10):
        post.observe(torch.arange(2), torch.full((2,), 0.5), torch.zeros(2, dtype=torch.long), torch.full((2,), 6))
    post.reset(torch.tensor([1]), ["code"])  # a new request of the domain
    assert float(post.estimate(torch.tensor([1]))[0]) < 0.25


def _forced(bs: int, rates: dict[str, float]) -> tuple[int, int]:
    """(drafted, forced) rows of the first step of a cold batch of `bs` code rows under a prior (DEAR prices: a drafted row
    costs a plain step's share many times over, whole accepted blocks would still pay)."""
    post = SurvivalPosterior(bs)
    post.set_prior(rates)
    post.reset(torch.arange(bs), ["code"] * bs)
    choice = DraftChoice(post, 16, 2, "cpu", probe_share=0.0)
    seqs = [SimpleNamespace(since_draft=0, probe_gap=16) for _ in range(bs)]
    cost = StepCostModel(fixed=0.012, per_token=0.0003, per_draft=0.003, draft_fixed=0.007)
    drafted, probes = choice.choose(seqs, [16] * bs, cost, measured=False)
    return len(drafted), len(probes)


def test_rows_the_eval_rates_need_no_first_read():
    """Eight code rows where the eval rates code as poor: nobody reads the drafter (the plan
    prices them by the prior, and it says drafting does not pay). Rated well at c=8 they are
    planned, not forced. Control: with no prior FIRST_READS of them read it."""
    assert _forced(8, {}) == (draft_choice.FIRST_READS, draft_choice.FIRST_READS)
    assert _forced(8, {"code": survival_from_tau(1.14, 16)}) == (0, 0)
    drafted, forced = _forced(8, {"code": survival_from_tau(12.0, 16)})
    assert drafted == 8 and forced == 0


def _first_steps_drafted(target, drafter, manifest, steps: int = 6) -> list[int]:
    """Rows drafted per decode step of a cold engine serving 4 "math" requests at c=1 prices."""
    drafter.manifest = manifest
    try:
        eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=4, max_seq_len=128, cost_model=ONE_ROW)
    finally:
        drafter.manifest = None
    for p in _prompts(4, seed=41):
        eng.submit(Request(p, SamplingParams(max_new_tokens=24), domain="math"))
    eng.step()  # admission and prefill
    before, out = 0, []
    for _ in range(steps):
        eng.step()
        now = sum(sum(seq.stats.drafted) for seq in eng.running)
        out.append(now - before)
        before = now
    return out


def test_an_engine_starts_from_its_drafters_eval(target, drafter):
    """The engine seeds its calibration from the drafter's manifest: rated poor on math, a cold
    engine drafts none of its math rows (no first reads); with no manifest it reads the drafter
    on its first step (control)."""
    poor = {"eval": {"tau_by_domain": {"math": 1.02}}}
    assert _first_steps_drafted(target, drafter, None)[0] > 0
    assert sum(_first_steps_drafted(target, drafter, poor)) == 0


def test_a_swap_starts_from_the_new_versions_eval(target, drafter):
    """drafter_swapped(manifest) replaces the prior with the new version's: after a swap to a
    version rated poor on math, no math row reads the drafter; after a swap with no manifest the
    domain is cold again, and the first new request reads it (a first read)."""
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=4, max_seq_len=128, cost_model=ONE_ROW)
    eng.drafter_swapped({"eval": {"tau_by_domain": {"math": 1.02}}})
    assert set(eng.posterior.prior) == {"math"} and eng.drafter.manifest is not None
    eng.submit(Request(_prompts(1, seed=43)[0], SamplingParams(max_new_tokens=16), domain="math"))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.committed_tokens > 0
    assert eng.stats.verified_tokens == eng.stats.steps, "a row rated poor read the drafter"
    eng.drafter_swapped(None)
    assert eng.posterior.prior == {} and eng.drafter.manifest is None
    eng.stats = type(eng.stats)()
    eng.submit(Request(_prompts(1, seed=44)[0], SamplingParams(max_new_tokens=16), domain="math"))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.verified_tokens > eng.stats.steps, "a cold domain's first request reads the drafter"


def test_a_loaded_drafter_carries_its_manifest():
    """load_drafter keeps the version's manifest on the drafter (what the engine seeds from):
    the shipped drafter's eval names the three domains."""
    from sglang_adaflash.assets import DRAFTER_DIR
    from sglang_adaflash.drafter.checkpoint import load_drafter

    manifest = load_drafter(DRAFTER_DIR).manifest
    assert set(acceptance_prior(manifest, 16)) == {"code", "math", "prose"}


def test_a_domain_the_eval_alone_rates_makes_no_other_domain_a_probe_worth_paying():
    """could_pay reads the best evidence verification has shown: math rows failing live, beside
    a code domain that only the eval rates well, are a long shot at one request (full probes
    for them would be paid on the eval's word); once code requests have shown it live, they
    are not (the rule for any domain's live evidence). A code row in the batch counts at its
    prior rate."""
    post = SurvivalPosterior(2)
    post.set_prior({"code": survival_from_tau(6.0, 16)})
    post.reset(torch.arange(1), ["math"])
    for _ in range(20):
        post.observe(torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0]), torch.tensor([16]))
    assert not DraftChoice(post, 16, 2, "cpu").could_pay(1, ONE_ROW)
    post.reset(torch.tensor([1]), ["code"])  # a code request in the batch
    assert DraftChoice(post, 16, 2, "cpu").could_pay(2, ONE_ROW)
    post.observe(torch.tensor([1]), torch.tensor([0.5]), torch.tensor([5]), torch.tensor([6]))
    post.reset(torch.tensor([1]), ["math"])  # it left; code has shown it live
    assert DraftChoice(post, 16, 2, "cpu").could_pay(1, ONE_ROW)
    post.forget({"code": survival_from_tau(6.0, 16)})  # a new version: live evidence gone
    post.reset(torch.arange(2), ["math", "math"])
    assert not post.observed.any()
