"""Trees from the first drafter alone (`branch_drafter="first"`): each branch is the first
drafter's next-ranked token at a recovery point. Lossless at T=0 (equal to `ar`, requests
joining mid-run) and at T>0 (every position follows the target; control: the verifier told the
distribution of the wrong slot); the second drafter is never run."""

import pytest

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

from ..engine.test_lossless_sampling import BLOCK, NEW, PROMPT, VOCAB
from .conftest import OracleD2SD, assert_follows_target
from .test_d2sd_engine import _prompts, _run


@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("rule", ["fixed", "load_aware"])
def test_greedy_equals_ar_with_joins(target, drafter, oracle, rule):
    """The oracle ranks the right token second where it corrupts a chain slot, so the first
    drafter's branches win there; no recovery drafter is given, and none is run."""
    prompts = _prompts(7, seed=2)
    max_new = [9, 1, 17, 5, 12, 3, 20]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128), prompts, max_new)
    cls = OracleD2SD if oracle else D2SDEngine
    eng = cls(target, drafter, None, tree_k=3, branch_len=4, branch_width=2, tree_rule=rule,
              branch_drafter="first", max_batch_size=3, max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    assert eng.branch_len == 1 and eng.proposer.rcache is None
    assert _run(eng, prompts, max_new) == ar
    assert eng.tree_stats["branches"] > 0, eng.tree_stats
    if oracle:
        assert eng.tree_stats["branch_wins"] > 5, eng.tree_stats


def test_the_recovery_drafter_is_not_run(target, drafter, monkeypatch):
    from .conftest import recovery_for

    def boom(*a, **kw):
        raise AssertionError("the recovery drafter ran")

    monkeypatch.setattr("sglang_adaflash.d2sd.recovery_drafter.TreeProposer.propose_branches", boom)
    eng = OracleD2SD(target, drafter, recovery_for(drafter), tree_k=3, tree_rule="fixed", branch_drafter="first",
                     max_batch_size=2, max_seq_len=128)
    assert eng.recovery is None
    _run(eng, _prompts(3, seed=4), [12] * 3)
    assert eng.tree_stats["branch_wins"] > 0
    with pytest.raises(ValueError, match="branch_drafter"):
        D2SDEngine(target, drafter, None, branch_drafter="second")
    with pytest.raises(ValueError, match="recovery drafter"):
        D2SDEngine(target, drafter, None)


class _NextSlotDraws(D2SDEngine):
    """Draws each first-drafter branch from the next slot's distribution (an off-by-one slot)
    but tells the verifier the right slot's: the rejection step then divides by a q the token
    was not drawn from."""

    def _first_drafter_branches(self, seqs, rows, chain_l, pending, hot_set, q):
        out = super()._first_drafter_branches(seqs, rows, chain_l, pending, hot_set, q.roll(-1, dims=1))
        for j, branches in out.items():
            for b in branches:
                if b.probs is not None:
                    told = q[j, b.slot - 1].clone()
                    told[chain_l[j][b.slot - 1]] = 0.0
                    b.probs = (told / told.sum())[None]
        return out


@pytest.mark.parametrize("wrong", [False, True])
def test_every_position_follows_the_target_at_t_above_zero(wrong):
    """Three recovery points a step, one branch each (the further alternatives share
    _sampled_alternatives with the recovery drafter's, tested there). At this temperature a
    branch's q told without renormalising after the chain's token is removed fails it too (p
    about 1e-7 against 1.7e-5 allowed), not only the off-by-one control."""
    target = tiny_target(seed=5, vocab=VOCAB, layers=2)
    drafter = tiny_drafter(seed=6, vocab=VOCAB, block_size=BLOCK, target_layers=2)
    cls = _NextSlotDraws if wrong else D2SDEngine
    eng = cls(target, drafter, None, tree_k=3, tree_rule="fixed", branch_drafter="first",
              max_batch_size=64, max_seq_len=32, seed=321)
    sp = SamplingParams(temperature=0.8, top_k=3, max_new_tokens=NEW)
    outs = eng.run([Request(list(PROMPT), sp) for _ in range(6000)])
    assert eng.tree_stats["branch_wins"] > 300, eng.tree_stats
    assert_follows_target(target, sp, [tuple(o.output_ids) for o in outs], wrong)
