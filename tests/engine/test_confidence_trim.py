"""The confidence trim (planner.confidence): its calibration, its plan, and an engine that uses it
losslessly (T=0 equal to `ar` with joins; T>0 every verified position follows the target, with a
trim that looks at the draws as the control that must be rejected)."""

import itertools

import numpy as np
import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.confidence import ConfidenceCalibration, trim_lengths
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.planner.lengths import PlanCost
from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

from .conftest import OracleProposer
from .test_lossless_greedy import _prompts
from .test_lossless_sampling import BLOCK, NEW, PROMPT, VOCAB, _conditional_pvalues


def test_calibration_counts_reached_and_accepted_proposals():
    """Proposal j was reached when j <= accepted (and it was verified), accepted when j < accepted."""
    cal = ConfidenceCalibration(bins=4, prior_weight=0.0, decay=1.0)
    cal.reached[:] = 0.0
    # row 0: 3 verified, 1 accepted -> p 0.1 accepted, p 0.6 rejected, p 0.9 not reached
    # row 1: 2 verified, 2 accepted -> p 0.3 and p 0.8 accepted; the third slot was not verified
    cal.observe(np.array([[0.1, 0.6, 0.9], [0.3, 0.8, 0.95]]), np.array([3, 2]), np.array([1, 2]))
    assert cal.reached.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert cal.accepted.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_calibration_learns_an_underconfident_drafter_and_forgets_on_reset():
    cal = ConfidenceCalibration(bins=10)
    assert np.allclose(cal.rate(np.array([0.05, 0.55, 0.95])), [0.05, 0.55, 0.95])  # the prior: taken at its word
    rng = np.random.default_rng(0)
    for _ in range(400):  # proposals at p = 0.3 accepted 80% of the time
        ok = rng.random(8) < 0.8
        cal.observe(np.full((8, 1), 0.3), np.ones(8, dtype=np.int64), ok.astype(np.int64))
    assert abs(float(cal.rate(np.array([0.3]))[0]) - 0.8) < 0.05
    assert abs(float(cal.rate(np.array([0.9]))[0]) - 0.95) < 0.05  # other bins keep the prior
    cal.reset()
    assert abs(float(cal.rate(np.array([0.3]))[0]) - 0.35) < 1e-6


def _tokens(rates, n: int) -> float:
    """E[committed] of a row verifying n slots: its bonus token, then each proposal while all before it survived."""
    return 1.0 + sum(float(np.prod(rates[:k], dtype=np.float64)) for k in range(1, n))


def _value(rates, lens, cost):
    tokens = sum(_tokens(r, int(n)) for r, n in zip(rates, lens))
    multi = [n for n in lens if n > 1]
    return tokens / (cost.fixed + sum(cost.per_token * n - cost.per_proposal for n in lens)
                     + cost.per_draft * len(multi) + (cost.draft_fixed if multi else 0.0))


def _best(rates, planned, keep, cost):
    options = [[int(p)] if k else range(1, int(p) + 1) for p, k in zip(planned, keep)]
    return max(_value(rates, lens, cost) for lens in itertools.product(*options))


def test_trim_is_the_best_cut_within_the_plan_by_brute_force():
    """Every row stays within its planned length, kept rows keep theirs, and no other cut of the
    batch yields more expected tokens per second (enumerated), with and without a price for
    verifying more than the bonus token."""
    g = np.random.default_rng(1)
    for _ in range(150):
        bs, block = int(g.integers(1, 4)), 6
        rates = (g.random((bs, block - 1)) ** g.uniform(0.3, 3)).astype(np.float32)
        planned = g.integers(1, block + 1, bs)
        keep = g.random(bs) < 0.3
        # the verify's price of leaving its single-token path, per row and per step, in half the cases
        multi = g.random() < 0.5
        cost = PlanCost(fixed=float(g.uniform(0.5, 2)), per_token=float(g.uniform(0.01, 0.6)),
                        per_draft=float(g.uniform(0, 0.5)) * multi, draft_fixed=float(g.uniform(0, 2)) * multi)
        lens = trim_lengths(rates, planned, keep, cost, block, min_len=1)
        assert (lens <= planned).all() and (lens >= 1).all()
        assert (lens[keep] == planned[keep]).all()
        assert _value(rates, lens, cost) >= _best(rates, planned, keep, cost) * (1 - 1e-5)


def test_trim_cuts_where_the_drafter_is_unsure_and_keeps_where_it_is_sure():
    cost = PlanCost(fixed=1.0, per_token=0.2)
    rates = np.array([[0.97, 0.96, 0.95, 0.1, 0.9], [0.1, 0.1, 0.9, 0.9, 0.9]], dtype=np.float32)
    lens = trim_lengths(rates, np.array([6, 6]), np.zeros(2, dtype=bool), cost, 6, min_len=2)
    assert lens.tolist() == [4, 1]  # three sure proposals, then a guess; a guess first


# -- the engine -----------------------------------------------------------------------------

# verified tokens nearly free, so the history plan drafts whole blocks and the cuts are the trim's
CHEAP_VERIFY = StepCostModel(fixed=1.0, per_token=1e-6)
UNSURE_BELOW = 0.188  # about the 30th percentile of the tiny drafter's top probabilities


@pytest.fixture
def sharp_calibration(monkeypatch):
    """The tiny drafter's probabilities are nearly uniform (its top probability is 0.18-0.20), so
    a learned calibration cannot tell its proposals apart and would cut all of them alike. A
    fixed map that trusts the surer 70% of proposals makes every cut depend on the proposal's
    distribution, which is what these tests need to exercise."""
    monkeypatch.setattr(ConfidenceCalibration, "rate",
                        lambda self, p: np.where(np.asarray(p) >= UNSURE_BELOW, 0.95, 0.05).astype(np.float32))


def _pair():
    return tiny_target(seed=5, vocab=VOCAB, layers=2), tiny_drafter(seed=6, vocab=VOCAB, block_size=BLOCK, target_layers=2)


def _trimming_engine(target, drafter, **kw):
    return SpecEngine(target, drafter, mode="adaflash", lengths_from="history", confidence_trim=True,
                      seed=321, cost_model=CHEAP_VERIFY, **kw)


class UnsureWhenWrong(OracleProposer):
    """The target's greedy continuation with injected mistakes (OracleProposer), whose logits are
    sure of a right proposal and nearly flat on a wrong one: a drafter whose confidence means
    something, as a trained one's does."""

    def propose(self, last, ctx_lens, histories, slots=None, read=None):
        states = super().propose(last, ctx_lens, histories, slots, read)
        truth = torch.tensor([self._continuation(h, self.block_size - 1) for h in histories])
        self._sure = self._props == truth  # [bs, B-1]
        return states

    def proposal_logits(self, hidden, rows, slots):
        logits = super().proposal_logits(hidden, rows, slots)
        sure = self._sure[rows, slots - 1]
        return torch.where(sure[:, None], logits, logits / 20.0)  # a wrong proposal's top probability: about 0.08


def _greedy_run(target, drafter, prompts, max_new, trim: bool):
    eng = SpecEngine(target, drafter, mode="adaflash", lengths_from="history", confidence_trim=trim,
                     max_batch_size=3, max_seq_len=128, cost_model=StepCostModel(0.01, 0.001),
                     proposer=UnsureWhenWrong(target, drafter, error_rate=0.3))
    return eng, eng.run([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new)])


def test_greedy_output_with_the_trim_equals_plain_decoding_with_joins(target, drafter):
    """T=0, six requests through three slots (joins mid-run): the trimmed engine commits `ar`'s
    tokens, and with a drafter unsure exactly where it is wrong the trim verifies fewer slots
    than the plan alone for as many accepted proposals (the calibration learned what its
    probabilities mean)."""
    prompts = _prompts(6, seed=11)
    max_new = [30, 7, 22, 15, 2, 26]
    ar = SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128).run(
        [Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new)])
    plain_eng, planned = _greedy_run(target, drafter, prompts, max_new, trim=False)
    eng, trimmed = _greedy_run(target, drafter, prompts, max_new, trim=True)
    assert [o.output_ids for o in trimmed] == [o.output_ids for o in ar] == [o.output_ids for o in planned]
    assert eng.stats.trimmed_slots > 10, eng.stats.trimmed_slots
    assert eng.stats.verified_tokens < plain_eng.stats.verified_tokens
    assert eng.stats.steps <= plain_eng.stats.steps * 1.1  # the slots cut were mostly ones the target would reject


def test_the_trim_is_asked_for_and_only_where_lengths_come_from_history():
    target, drafter = _pair()
    assert SpecEngine(target, drafter, mode="adaflash").confidence is None  # off by default (docs/engine.md)
    assert SpecEngine(target, drafter, mode="adaflash", confidence_trim=True).confidence is not None
    assert SpecEngine(target, drafter, mode="adaflash", lengths_from="head", confidence_trim=True).confidence is None
    assert SpecEngine(target, drafter, mode="dflash", confidence_trim=True).confidence is None


def _cut_at_the_first_unlikely_draw(proposals):
    """A known-wrong trim: it ends a sampled row's verify at the first proposal that is not its
    distribution's most likely token, which looks at the draw (speculative sampling then no longer
    sees proposals drawn from q)."""

    def wrong(self, seqs, spec, hidden, trim=False):
        proposals(self, seqs, spec, hidden, trim=trim)
        if spec.draft_probs is None:
            return
        ids, top = spec.draft_ids.cpu(), spec.draft_probs.argmax(-1).cpu()
        sampled = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]  # draft_probs' rows
        forced = set(spec.probes)  # first reads and probes keep their verify, as the real trim leaves them
        for h, i in enumerate(sampled):
            for j in range(int(spec.lengths[i]) - 1 if i not in forced else 0):
                if ids[i, j] != top[h, j]:
                    spec.lengths[i] = j + 1
                    break

    return wrong


@pytest.mark.parametrize("wrong", [False, True])
def test_every_verified_position_follows_the_target_with_the_trim(wrong, sharp_calibration, monkeypatch):
    """T>0, greedy rows in the same batches: the conditional distribution at every position is
    the target's while the trim cuts verifies short. Control (wrong=True): a trim that reads the
    draws is rejected."""
    if wrong:
        monkeypatch.setattr(SpecEngine, "_proposals", _cut_at_the_first_unlikely_draw(SpecEngine._proposals))
    target, drafter = _pair()
    eng = _trimming_engine(target, drafter, max_batch_size=64, max_seq_len=32)
    sp = SamplingParams(temperature=0.6, top_k=3, max_new_tokens=NEW)
    greedy = SamplingParams(max_new_tokens=NEW)
    reqs = [Request(list(PROMPT), greedy if i % 10 == 0 else sp) for i in range(5000)]
    outs = eng.run(reqs)
    samples = [tuple(o.output_ids) for o, r in zip(outs, reqs) if not r.sampling.greedy]
    assert len({tuple(o.output_ids) for o, r in zip(outs, reqs) if r.sampling.greedy}) == 1
    assert eng.stats.trimmed_slots > 1000, eng.stats.trimmed_slots
    pvalues = _conditional_pvalues(target, sp, samples)
    if wrong:
        assert min(pvalues) < 1e-6, pvalues
    else:
        deep = sum(1 for o in outs for a in o.stats.accept_lens if a >= BLOCK)
        assert deep > 150, "whole blocks must be accepted for the deep positions to be checked"
        assert min(pvalues) > 1e-4 / NEW, pvalues
