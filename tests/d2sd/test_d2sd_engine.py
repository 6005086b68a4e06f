"""Mode d2sd is lossless: T=0 equals plain greedy decoding (requests joining mid-run); T>0
follows the target's distribution at every position (chi-square, with a wrong-sampler control)."""

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.tree import Branch
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel

from ..engine.test_lossless_sampling import NEW, PROMPT
from .conftest import OracleD2SD, assert_follows_target, recovery_for, sampling_models
from .test_tree_verify import _no_residual_walk


def _prompts(n, seed=3, lo=2, hi=14, vocab=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _run(eng, prompts, max_new):
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new)])
    assert all(o.ok for o in outs)
    return [o.output_ids for o in outs]



@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("rule", ["fixed", "load_aware"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_ar_with_joins(target, drafter, oracle, rule, batch):
    prompts = _prompts(7, seed=batch)
    max_new = [9, 1, 17, 5, 12, 3, 20]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=batch, max_seq_len=128), prompts, max_new)
    cls = OracleD2SD if oracle else D2SDEngine
    eng = cls(target, drafter, recovery_for(drafter), tree_k=3, branch_len=4, tree_rule=rule,
              max_batch_size=batch, max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    assert _run(eng, prompts, max_new) == ar
    if oracle:
        assert eng.tree_stats["branch_wins"] > 5, eng.tree_stats  # paths through branches were committed
        taus = eng.stats.committed_tokens / eng.stats.steps
        assert taus > 2


@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("rule", ["fixed", "load_aware"])
def test_greedy_equals_ar_with_more_alternatives_per_slot(target, drafter, oracle, rule):
    prompts = _prompts(6, seed=4)
    max_new = [14, 2, 19, 7, 11, 16]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128), prompts, max_new)
    cls = OracleD2SD if oracle else D2SDEngine
    eng = cls(target, drafter, recovery_for(drafter), tree_k=2, branch_len=3, branch_width=3, tree_rule=rule,
              max_batch_size=3, max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    assert _run(eng, prompts, max_new) == ar
    assert eng.tree_stats["alternatives"] > 10, eng.tree_stats


def test_alternatives_are_tried_and_counted_by_rank(target, drafter):
    """The oracle ranks the right token second where it corrupts a slot, so at a branch's slot
    the recovery drafter's second alternative is the one that wins; the rates are kept per rank."""
    from .conftest import OracleD2SD as Base

    class SecondBest(Base):
        def _branch_logits(self, seqs, block_ids, rows, read):
            out = super()._branch_logits(seqs, block_ids, rows, read)
            vocab = out.shape[-1]
            for m, i in enumerate(rows):  # a decoy above the oracle's best token at the branch's slot
                r, first = int(read[m, 0]), out[m, 0]
                best = int(first.argmax())
                decoy = next(t for t in range(vocab) if t not in (best, self._chains[i][r - 1]))
                first[decoy] = first[best] + 1.0
            return out

    prompts = _prompts(4, seed=6)
    eng = SecondBest(target, drafter, recovery_for(drafter), tree_k=2, branch_len=2, branch_width=3,
                     tree_rule="fixed", max_batch_size=4, max_seq_len=128)
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=4, max_seq_len=128), prompts, [20] * 4)
    assert _run(eng, prompts, [20] * 4) == ar
    won = [o[0] for o in eng._alt_obs]
    assert won[0] < won[1] + won[2], eng._alt_obs
    assert eng._alt_rate(0) < max(eng._alt_rate(1), eng._alt_rate(2))


def test_greedy_equals_ar_through_the_torch_cascade(target, drafter):
    """The two-level tree attention (context, then nodes, merged) in the whole engine."""
    prompts = _prompts(5, seed=9)
    max_new = [12, 3, 17, 8, 10]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128), prompts, max_new)
    eng = OracleD2SD(target, drafter, recovery_for(drafter), tree_k=3, branch_len=4, tree_rule="fixed",
                     tree_attention="torch", max_batch_size=3, max_seq_len=128)
    assert eng.tree_attention == "torch"
    assert _run(eng, prompts, max_new) == ar
    assert eng.tree_stats["branch_wins"] > 3, eng.tree_stats


def test_branches_add_accepted_tokens_over_the_chain(target, drafter):
    """The same oracle chain with and without branches (tree_k=0 is a chain)."""
    prompts = _prompts(4, seed=5)
    max_new = [24] * 4
    steps = {}
    for k in (0, 3):
        eng = OracleD2SD(target, drafter, recovery_for(drafter), tree_k=k, branch_len=4, tree_rule="fixed",
                         max_batch_size=4, max_seq_len=128)
        _run(eng, prompts, max_new)
        steps[k] = eng.stats.steps
    assert steps[3] < steps[0]


def test_load_aware_tree_shrinks_to_a_chain_when_verify_tokens_are_dear(target, drafter):
    prompts = _prompts(6, seed=7)
    cheap = OracleD2SD(target, drafter, recovery_for(drafter), tree_k=3, branch_len=4, max_batch_size=6,
                       max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    dear = OracleD2SD(target, drafter, recovery_for(drafter), tree_k=3, branch_len=4, max_batch_size=6,
                      max_seq_len=128, cost_model=StepCostModel(1e-4, 1.0))
    _run(cheap, prompts, [16] * 6)
    _run(dear, prompts, [16] * 6)
    assert cheap.tree_stats["branch_tokens"] > 0
    assert dear.tree_stats["branch_tokens"] == 0


# -- T > 0 ------------------------------------------------------------------------------------
# (the per-position chi-square is the engine's own losslessness test's, on the same tiny pair)

def _mixed_run(eng, sp, n=4000):
    """n requests of PROMPT, every tenth greedy (those must agree), the rest sampled with sp:
    the sampled outputs."""
    greedy = SamplingParams(max_new_tokens=NEW)
    reqs = [Request(list(PROMPT), greedy if i % 10 == 0 else sp) for i in range(n)]
    outs = eng.run(reqs)
    assert len({tuple(o.output_ids) for o, r in zip(outs, reqs) if r.sampling.greedy}) == 1
    return [tuple(o.output_ids) for o, r in zip(outs, reqs) if not r.sampling.greedy]


@pytest.mark.parametrize("wrong", [False, True])
def test_every_position_follows_the_target_at_t_above_zero(wrong, monkeypatch):
    """Trees with two branches per step, greedy rows mixed in; control: a sampler that does not
    move to the residual after a rejected candidate is rejected."""
    if wrong:
        monkeypatch.setattr("sglang_adaflash.d2sd.engine.sampling_walk", _no_residual_walk)
    target, drafter, recovery = sampling_models()
    eng = D2SDEngine(target, drafter, recovery, tree_k=2, branch_len=2, tree_rule="fixed", max_batch_size=64,
                     max_seq_len=32, seed=321)
    sp = SamplingParams(temperature=0.6, top_k=3, max_new_tokens=NEW)
    samples = _mixed_run(eng, sp)
    assert eng.tree_stats["branch_wins"] > 300, eng.tree_stats
    assert_follows_target(target, sp, samples, wrong)


class _WrongAlternativeQ(D2SDEngine):
    """Draws the further alternatives right but tells the verifier the distribution before the
    earlier tokens were removed: the rejection step then divides by the wrong q."""

    def _sampled_alternatives(self, r, dist, tried, n, seq):
        out = super()._sampled_alternatives(r, dist, tried, n, seq)
        return [Branch(b.slot, b.tokens, dist[None].clone()) for b in out]


@pytest.mark.parametrize("wrong", [False, True])
def test_further_alternatives_follow_the_target_at_t_above_zero(wrong):
    """Three branches a step, one node each, with two more alternatives at each branch's slot:
    every committed position follows the target. At a higher temperature the drafts are often
    wrong, so alternatives are tried often; the control gives them the wrong proposal q (p about
    1e-15 here, the right sampler about 0.1)."""
    target, drafter, recovery = sampling_models()
    cls = _WrongAlternativeQ if wrong else D2SDEngine
    eng = cls(target, drafter, recovery, tree_k=3, branch_len=1, branch_width=3, tree_rule="fixed",
              max_batch_size=64, max_seq_len=32, seed=321)
    sp = SamplingParams(temperature=1.2, top_k=3, max_new_tokens=NEW)
    outs = eng.run([Request(list(PROMPT), sp) for _ in range(6000)])
    assert eng.tree_stats["alternatives"] > 20000, eng.tree_stats
    assert eng._alt_obs[1][0] > 10, eng._alt_obs  # second alternatives were accepted (decayed count)
    assert_follows_target(target, sp, [tuple(o.output_ids) for o in outs], wrong)


def test_drafter_contexts_hold_the_committed_path_only(target, drafter):
    """Both drafters' context K/V after a run equal those computed from a plain forward of the
    committed tokens: features of rejected nodes and branches never enter them."""
    from sglang_adaflash.target.hf_target import TargetBatch

    prompt = _prompts(1, seed=11)[0]
    eng = OracleD2SD(target, drafter, recovery_for(drafter), tree_k=3, branch_len=4, tree_rule="fixed",
                     max_batch_size=1, max_seq_len=128)
    eng.proposer.FLUSH_AFTER = 1  # the recovery cache filled every step (lazily, a retired slot's queue is dropped)
    out = eng.run([Request(prompt, SamplingParams(max_new_tokens=30))])[0]
    assert eng.tree_stats["branch_wins"] > 0
    toks = prompt + out.output_ids[:-1]  # the last token's K/V is not committed yet
    fresh = target.new_cache(1, 128)
    target.capture_layer_ids = list(drafter.config.target_layer_ids)
    _, feats = target.forward(TargetBatch.from_lists([toks], [0]), fresh)
    pos = torch.arange(len(toks))[None]
    for model, cache in ((drafter, eng.proposer.cache), (eng.recovery, eng.proposer.rcache)):
        with torch.inference_mode():
            kvs = model.context_kv(model.project_context(feats[None]), pos)
        for layer, (k, v) in enumerate(kvs):
            torch.testing.assert_close(cache.k[layer][0, :, : len(toks)], k[0], rtol=1e-8, atol=1e-8)
            torch.testing.assert_close(cache.v[layer][0, :, : len(toks)], v[0], rtol=1e-8, atol=1e-8)
