"""The chain's LM head reads the first CHAIN_HEAD_SLOTS slots, and the rest of the block only
when some row's plan keeps its chain to the last slot read (then the plan is made again).

A short head must give the plans the whole block gives, step for step (a head whose tail is
never read must not: the control), stay equal to `ar` at T=0, and follow the target at every
position at T>0 with the tail read on some steps and not on others."""

import pytest

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.planner.cost import StepCostModel

from ..engine.test_lossless_sampling import NEW
from .conftest import OracleD2SD, assert_follows_target, recovery_for, sampling_models
from .test_d2sd_engine import _mixed_run, _prompts, _run
from .test_tree_verify import _no_residual_walk


class _Head2(OracleD2SD):
    CHAIN_HEAD_SLOTS = 2


class _Whole(OracleD2SD):
    CHAIN_HEAD_SLOTS = None


class _Adaptive(OracleD2SD):
    """The default head: one slot past the longest chain of recent steps, at most 6 of the
    tiny drafter's 7 slots here."""

    CHAIN_HEAD_SLOTS = 6
    CHAIN_REACH_STEPS = 4

    def _chain_logits(self, seqs, rows, upto=None):
        self.heads = getattr(self, "heads", []) + [upto]
        return super()._chain_logits(seqs, rows, upto)


class _NoTail(_Head2):
    """The control: the tail is never read, so chains stop at the head."""

    def _chain_tail(self, seqs, rows, start):
        return super()._chain_tail(seqs, rows, start)[:, :0]


def _oracle_run(cls, target, drafter, source, prompts, max_new, engine=False, error_rate=0.5, per_token=1e-4):
    rec = None if source == "first" else recovery_for(drafter)
    eng = cls(target, drafter, rec, tree_k=3, branch_len=1 if source == "first" else 3, branch_width=2,
              tree_rule="load_aware", branch_drafter=source, max_batch_size=1, max_seq_len=128,
              cost_model=StepCostModel(1.0, per_token), error_rate=error_rate)
    out = _run(eng, prompts, max_new)
    stats = {k: v for k, v in eng.tree_stats.items() if k != "chain_tail_reads"}
    found = (out, (stats, eng.stats.steps, eng.stats.verified_tokens), eng.tree_stats["chain_tail_reads"])
    return (*found, eng) if engine else found


@pytest.mark.parametrize("source", ["first", "joint"])
def test_a_short_head_plans_as_the_whole_block_does(target, drafter, source):
    prompts = _prompts(6, seed=41)
    max_new = [24, 3, 30, 12, 20, 7]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128), prompts, max_new)
    whole, whole_plans, none_read = _oracle_run(_Whole, target, drafter, source, prompts, max_new)
    short, short_plans, tail_reads = _oracle_run(_Head2, target, drafter, source, prompts, max_new)
    assert whole == short == ar
    assert none_read == 0
    planned = short_plans[0]["planned_steps"]
    assert 0 < tail_reads < planned, (tail_reads, planned)  # both paths ran
    assert short_plans == whole_plans
    # control: without the tail the chains stop at the head, and the plans differ
    cut, cut_plans, _ = _oracle_run(_NoTail, target, drafter, source, prompts, max_new)
    assert cut == ar and cut_plans != whole_plans


@pytest.mark.parametrize("source", ["first", "joint"])
def test_the_head_follows_the_planned_chains_and_plans_as_the_whole_block_does(target, drafter, source):
    """The default head reads one slot past the longest chain of the last few steps: it shrinks
    when the chains do and grows (through a tail read) when they grow, with the whole block's
    plans step for step."""
    prompts = _prompts(6, seed=41)
    max_new = [24, 3, 30, 12, 20, 7]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128), prompts, max_new)
    # an oracle drafter wrong at 40% of its slots and a dearer verify token: chains of every
    # length are planned (heads of 2 to 6 slots, with tail reads where the chains grew)
    kw = dict(error_rate=0.4, per_token=0.05)
    whole, whole_plans, _ = _oracle_run(_Whole, target, drafter, source, prompts, max_new, **kw)
    out, plans, tail_reads, eng = _oracle_run(_Adaptive, target, drafter, source, prompts, max_new, engine=True, **kw)
    assert out == whole == ar
    assert plans == whole_plans
    assert eng.heads[0] == 6 and min(eng.heads) < 6 and len(set(eng.heads)) > 2, eng.heads
    assert tail_reads > 0


@pytest.mark.parametrize("wrong", [False, True])
def test_every_position_follows_the_target_with_a_short_head(wrong, monkeypatch):
    """Sampled chains drawn in two parts (the head, then the tail where it is read), greedy rows
    mixed in; verify priced low so that long chains are planned. Control: a sampler that does
    not move to the residual after a rejected candidate is rejected."""
    if wrong:
        monkeypatch.setattr("sglang_adaflash.d2sd.engine.sampling_walk", _no_residual_walk)

    class Head2(D2SDEngine):
        CHAIN_HEAD_SLOTS = 2

    target, drafter, recovery = sampling_models()
    eng = Head2(target, drafter, recovery, tree_k=2, branch_len=2, branch_width=2, tree_rule="load_aware",
                branch_drafter="joint", max_batch_size=64, max_seq_len=32, seed=321,
                cost_model=StepCostModel(1.0, 1e-6))
    sp = SamplingParams(temperature=0.6, top_k=3, max_new_tokens=NEW)
    samples = _mixed_run(eng, sp)
    assert 0 < eng.tree_stats["chain_tail_reads"] < eng.tree_stats["planned_steps"], eng.tree_stats
    assert_follows_target(target, sp, samples, wrong)
