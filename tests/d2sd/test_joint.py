"""`--branch-drafter joint`: the first and the recovery drafter as one stacked forward.

The stacked forward and context projection against each drafter's own (a swapped pair must
differ: the control), restacking after an in-place weight write (hot reload), refusal of a
recovery drafter of another shape, the per-slot plan against enumeration, T=0 equality with
`ar` with joins, the T>0 per-position test with its control, and where each source's
acceptance is recorded."""

import itertools

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.joint import JointDrafters
from sglang_adaflash.d2sd.recovery import TreeCost, candidates, chain_tau, first_fail, plan_branches
from sglang_adaflash.d2sd.recovery_drafter import TreeProposer
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.testing.fixtures import tiny_drafter

from ..engine.test_lossless_sampling import NEW, VOCAB
from .conftest import OracleD2SD, assert_follows_target, recovery_for, sampling_models
from .test_d2sd_engine import _mixed_run, _prompts, _run
from .test_tree_verify import _no_residual_walk


def _pair():
    first = tiny_drafter(seed=11, target_layers=3)
    return first, recovery_for(first, seed=12, target_layers=3)


def _inputs(first, n=2, ctx=(7, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = first.config
    b, h = cfg.block_size, cfg.hidden_size
    feats = torch.randn(n, max(ctx), cfg.num_context_layers * h, generator=g, dtype=torch.float64)
    positions = torch.arange(max(ctx))[None].expand(n, -1)
    embeds = torch.randn(n, b, h, generator=g, dtype=torch.float64)
    lens = torch.tensor(ctx)
    block_pos = lens[:, None] + torch.arange(b)[None]
    visible = torch.arange(max(ctx))[None] < lens[:, None]  # row 1's context is padded
    mask = torch.cat([visible, visible.new_ones(n, b)], 1)[:, None, None, :].expand(n, 1, b, max(ctx) + b)
    return feats, positions, embeds, block_pos, mask


def _own(d, feats, positions, embeds, block_pos, mask):
    kv = d.context_kv(d.project_context(feats), positions)
    return kv, d(embeds, block_pos, kv, mask)


def test_the_stacked_forward_is_each_drafters_own():
    first, rec = _pair()
    with torch.inference_mode():
        _check_stacked(first, rec)


def _check_stacked(first, rec):
    feats, positions, embeds, block_pos, mask = _inputs(first)
    joint = JointDrafters(first, rec)
    kv_a, kv_b = joint.context_kv(feats, positions)
    out_a, out_b = joint.forward(embeds, block_pos, kv_a, kv_b, mask)
    for d, kv, out in ((first, kv_a, out_a), (rec, kv_b, out_b)):
        want_kv, want = _own(d, feats, positions, embeds, block_pos, mask)
        for (k, v), (wk, wv) in zip(kv, want_kv):
            torch.testing.assert_close(k, wk)
            torch.testing.assert_close(v, wv)
        torch.testing.assert_close(out, want)
    # control: the pair the other way round answers with the other drafter's states
    swapped = JointDrafters(rec, first)
    kv_s = swapped.context_kv(feats, positions)
    wrong, _ = swapped.forward(embeds, block_pos, *kv_s, mask)
    assert (wrong - out_a).abs().max() > 1e-3


def test_an_in_place_weight_write_restacks():
    """Hot reload copies weights into the first drafter in place: the stack follows, and is
    not rebuilt when nothing changed."""
    first, rec = _pair()
    feats, positions, embeds, block_pos, mask = _inputs(first, seed=1)
    joint = JointDrafters(first, rec)
    with torch.inference_mode():
        joint.forward(embeds, block_pos, *joint.context_kv(feats, positions), mask)
        joint.forward(embeds, block_pos, *joint.context_kv(feats, positions), mask)
    assert joint.rebuilds == 1  # built once, then reused
    with torch.no_grad():
        first.layers[0].mlp.up_proj.weight.mul_(1.5)
        first.fc.weight.add_(0.1)
    with torch.inference_mode():
        out_a, _ = joint.forward(embeds, block_pos, *joint.context_kv(feats, positions), mask)
        _, want = _own(first, feats, positions, embeds, block_pos, mask)
    torch.testing.assert_close(out_a, want)
    assert joint.rebuilds == 2


def test_joint_refuses_a_recovery_drafter_of_another_shape(target, drafter):
    with pytest.raises(ValueError, match="joint.*num_hidden_layers"):
        D2SDEngine(target, drafter, recovery_for(drafter, layers=2), branch_drafter="joint")
    with pytest.raises(ValueError, match="recovery drafter"):
        D2SDEngine(target, drafter, None, branch_drafter="joint")


@torch.inference_mode()
def test_both_contexts_are_what_each_drafter_writes_alone():
    """The joint proposer's one stacked projection leaves both caches as the first drafter's
    writes and the recovery drafter's catch-up would, for consecutive and scattered slots."""
    first, rec = _pair()
    for d in (first, rec):
        d.share_target_modules(torch.nn.Embedding(VOCAB, 48).double(), torch.nn.Linear(48, VOCAB).double())
    joint = TreeProposer(first, rec, num_slots=4, capacity=32, joint=True)
    plain = TreeProposer(first, rec, num_slots=4, capacity=32)
    feats, *_ = _inputs(first, n=3, ctx=(6, 6, 6), seed=2)
    for slots, starts in (([0, 1, 2], [0, 0, 0]), ([3, 1], [0, 6])):
        part = feats[: len(slots)]
        for p in (joint, plain):
            p.extend_context(part, torch.tensor(starts), slots)
    plain.catch_up(list(range(4)))
    for a, b in ((joint.cache, plain.cache), (joint.rcache, plain.rcache)):
        torch.testing.assert_close(a.k[0], b.k[0])
        torch.testing.assert_close(a.v[0], b.v[0])


def _value(conf, rho, lengths, cost, slots, ls, ms, *, alts, beta):
    """Expected tokens per second of the tree: branch lengths ls and alternatives ms at slots."""
    fail = first_fail(conf)
    gain, spent = 0.0, cost.fixed + float(lengths.sum()) * cost.per_token
    for i in range(slots.shape[0]):
        for j in range(slots.shape[1]):
            r, ln, m = int(slots[i, j]), int(ls[i, j]), int(ms[i, j])
            fr = float(fail[i, r - 1])
            gain += fr * float(rho[i, r - 1]) * sum(beta ** s for s in range(ln)) + fr * sum(alts[r - 1][:m])
            spent += (ln + m) * cost.per_token
    return (float(chain_tau(conf, lengths).sum()) + gain) / spent


def _best_per_slot(conf, rho, lengths, cost, *, lmax, alts, beta, k=2):
    """The best tokens per second over every tree with per-slot branch limits lmax [S] and
    per-slot alternative rates alts [S][W-1]."""
    slots, _ = candidates(conf, lengths, k)
    n = conf.shape[0]
    per = [[(ln, m) for ln in range(min(lmax[int(slots[i, j]) - 1], int(lengths[i]) - int(slots[i, j])) + 1)
            for m in range(len(alts[0]) + 1) if ln or not m] for i in range(n) for j in range(k)]
    best = 0.0
    for choice in itertools.product(*per):
        ls = torch.tensor([c[0] for c in choice]).view(n, k)
        ms = torch.tensor([c[1] for c in choice]).view(n, k)
        best = max(best, _value(conf, rho, lengths, cost, slots, ls, ms, alts=alts, beta=beta))
    return best


def test_the_per_slot_plan_is_the_best_by_enumeration():
    """Slot 1 may carry a branch of up to 3 tokens with its own rates, the other slots one node
    each with theirs (the joint tree); the plan's tree is the enumerated optimum, its reported
    value is that tree's, and no slot other than 1 gets more than one node."""
    g = torch.Generator().manual_seed(4)
    longer = 0
    for trial in range(10):
        conf = torch.rand(2, 5, generator=g) * 0.6 + 0.3
        conf[:, 0] = torch.rand(2, generator=g) * 0.5 + 0.2  # slot 1 often the likeliest failure
        rho_all = torch.rand(2, 5, generator=g) * 0.6 + 0.3
        lengths = torch.tensor([6, 5])
        lmax = [3, 1, 1, 1, 1]
        alts = [[0.3, 0.2]] + [[0.1, 0.05]] * 4
        cost = TreeCost(fixed=float(torch.rand((), generator=g)) * 0.02 + 0.004,
                        per_token=float(torch.rand((), generator=g)) * 9e-4 + 1e-4)
        plan = plan_branches(conf, rho_all, lengths, k=2, branch_len=torch.tensor(lmax).numpy(), beta=0.6,
                             cost=cost, alts=torch.tensor(alts, dtype=torch.float64).numpy())
        best = _best_per_slot(conf, rho_all, lengths, cost, lmax=lmax, alts=alts, beta=0.6)
        mine = _value(conf, rho_all, lengths, cost, plan.slots, plan.lengths, plan.extra, alts=alts, beta=0.6)
        assert abs(mine - plan.value) <= 1e-6 * plan.value, (trial, mine, plan.value)
        assert plan.value >= best * (1 - 1e-5), (trial, plan.value, best)
        assert ((plan.slots == 1) | (plan.lengths <= 1)).all(), (plan.slots, plan.lengths)
        longer += int((plan.lengths > 1).any())
    assert longer > 0  # slot 1's longer branch is used


def test_fixed_rule_gives_slot_one_its_length_and_the_others_one_node(target, drafter, monkeypatch):
    """Under the fixed rule every candidate branches: slot 1's branch runs up to branch_len
    nodes deep (the recovery drafter's continuation), every other branch is one node."""
    import sglang_adaflash.d2sd.engine as engine_mod

    rows = []
    real = engine_mod.build_row

    def recorded(*a, **kw):
        rows.append(real(*a, **kw))
        return rows[-1]

    monkeypatch.setattr(engine_mod, "build_row", recorded)
    eng = OracleD2SD(target, drafter, recovery_for(drafter), tree_k=3, branch_len=3, branch_width=2,
                     tree_rule="fixed", branch_drafter="joint", max_batch_size=2, max_seq_len=128)
    _run(eng, _prompts(2, seed=4), [24, 24])
    deep_at_one = 0
    for row in rows:
        kids, chain = row.children(), row.chain_length
        for node in range(chain, row.size):
            if row.parents[node] < chain:  # a branch's first node, hung under chain node r - 1
                depth, at = 1, node
                while [c for c in kids[at] if c >= chain]:
                    at, depth = kids[at][0], depth + 1
                if row.parents[node] == 0:
                    assert depth <= 3
                    deep_at_one += depth == 3
                else:
                    assert depth == 1, (row, node)
    assert deep_at_one > 5, deep_at_one


@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("rule", ["fixed", "load_aware"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_ar_with_joins(target, drafter, oracle, rule, batch):
    prompts = _prompts(7, seed=batch + 10)
    max_new = [9, 1, 17, 5, 12, 3, 20]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=batch, max_seq_len=128), prompts, max_new)
    cls = OracleD2SD if oracle else D2SDEngine
    eng = cls(target, drafter, recovery_for(drafter), tree_k=3, branch_len=3, branch_width=2, tree_rule=rule,
              branch_drafter="joint", max_batch_size=batch, max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    assert _run(eng, prompts, max_new) == ar
    if oracle:
        assert eng.tree_stats["branch_wins"] > 5, eng.tree_stats


def test_each_source_is_recorded_where_its_branches_were_tried(target, drafter):
    """Slot 1's alternatives are the recovery drafter's (its joint record), the others the first
    drafter's ranks (the first's record); the sequential recovery record does not move. Here
    the first drafter's second-ranked token is a decoy, never right, and the recovery oracle is
    right: only the joint record wins."""

    class Decoy(OracleD2SD):
        def _chain_full_logits(self, seqs, rows):
            out = super()._chain_full_logits(seqs, rows)
            for j in range(len(rows)):
                for k in range(out.shape[1]):
                    top = out[j, k].topk(2).indices.tolist()
                    if out[j, k, top[0]] == 3.0:  # a corrupted slot: the right token ranks second
                        decoy = next(t for t in range(out.shape[-1]) if t not in top)
                        out[j, k, decoy] = 2.8  # now the decoy does
            return out

    eng = Decoy(target, drafter, recovery_for(drafter), tree_k=3, branch_len=2, branch_width=1,
                tree_rule="fixed", branch_drafter="joint", max_batch_size=3, max_seq_len=128)
    _run(eng, _prompts(5, seed=7), [20] * 5)
    assert eng._joint_obs[0][0] > 0 and eng._first_obs[0][1] > 0, (eng._joint_obs, eng._first_obs)
    assert eng._first_obs[0][0] == 0, eng._first_obs
    assert eng._alt_obs[0][1] == 0


@pytest.mark.parametrize("wrong", [False, True])
def test_every_position_follows_the_target_at_t_above_zero(wrong, monkeypatch):
    """Joint trees (slot 1 from the recovery drafter, the other branches from the first
    drafter's distribution), greedy rows mixed in; control: a sampler that does not move to the
    residual after a rejected candidate is rejected."""
    if wrong:
        monkeypatch.setattr("sglang_adaflash.d2sd.engine.sampling_walk", _no_residual_walk)
    target, drafter, recovery = sampling_models()
    eng = D2SDEngine(target, drafter, recovery, tree_k=2, branch_len=2, branch_width=2, tree_rule="fixed",
                     branch_drafter="joint", max_batch_size=64, max_seq_len=32, seed=321)
    sp = SamplingParams(temperature=0.6, top_k=3, max_new_tokens=NEW)
    samples = _mixed_run(eng, sp)
    assert eng.tree_stats["branch_wins"] > 300, eng.tree_stats
    assert_follows_target(target, sp, samples, wrong)


def test_the_engine_reads_each_drafter_where_its_own_forward_would(target, drafter):
    """Mid-run, the joint forward's chain logits are the first drafter's own forward's (its
    context as the first drafter's writes leave it), and its slot-1..L recovery logits those of
    the recovery drafter's own forward over the block [last token, masks] (its context as the
    stacked projection left it): the slicing and both caches, checked against the sequential
    paths of modes `dflash` and `recovery`."""
    from sglang_adaflash.engine.request import Request

    eng = D2SDEngine(target, drafter, recovery_for(drafter), tree_k=2, branch_len=3, branch_width=2,
                     tree_rule="fixed", branch_drafter="joint", max_batch_size=3, max_seq_len=128)
    for p in _prompts(3, seed=5):
        eng.submit(Request(p, SamplingParams(max_new_tokens=30)))
    for _ in range(4):
        eng.step()
    seqs = eng.running
    rows = [2, 0] if len(seqs) == 3 else list(range(len(seqs)))  # scattered slots read by a gather
    with torch.inference_mode():
        chain, rec = eng._joint_logits(seqs, rows)
        torch.testing.assert_close(chain, eng._chain_logits(seqs, rows))
        b = eng.block_size
        ids = torch.full((len(rows), b), drafter.config.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([seqs[i].last_token for i in rows])
        read = torch.arange(1, 4)[None].expand(len(rows), -1)
        torch.testing.assert_close(rec, eng._branch_logits(seqs, ids, rows, read))
    assert len(seqs) == 3
