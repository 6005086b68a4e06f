"""Acceptance over draft trees: the greedy walk, and the multi-candidate rejection sampler's
output distribution (chi-square against the target's, with a known-wrong sampler as control)."""

import pytest
import torch
from scipy.stats import chisquare

from sglang_adaflash.d2sd import tree_verify
from sglang_adaflash.d2sd.tree import Branch, build_row
from sglang_adaflash.d2sd.tree_verify import greedy_walk, sampling_walk


def test_greedy_walk_follows_the_targets_argmax_through_branches():
    row = build_row(7, [11, 12, 13, 14], [Branch(1, [21, 22, 23]), Branch(3, [31, 32])])
    # nodes: 0:7 1:11 2:12 3:13 4:14 | 5:21 6:22 7:23 | 8:31 9:32
    ids = [0] * row.size
    ids[0] = 21  # the target disagrees with chain slot 1 and agrees with the branch there
    ids[5], ids[6], ids[7] = 22, 99, 0
    r = greedy_walk(row, ids)
    assert r.path == [0, 5, 6] and r.tokens == [21, 22, 99]
    ids = [11, 12, 31, 0, 0, 0, 0, 0, 32, 5]  # chain to slot 2, then the slot-3 branch to its end
    r = greedy_walk(row, ids)
    assert r.path == [0, 1, 2, 8, 9] and r.tokens == [11, 12, 31, 32, 5]
    ids = [11, 12, 13, 14, 0, 0, 0, 0, 0, 0]  # the whole chain, then its bonus
    assert greedy_walk(row, ids).tokens == [11, 12, 13, 14, 0]
    ids = [3] + [0] * 9  # nothing matches: the target's own token only
    assert greedy_walk(row, ids).path == [0] and greedy_walk(row, ids).tokens == [3]


V = 5


def _dists(seed):
    g = torch.Generator().manual_seed(seed)

    def d(*shape, sharp=1.5):
        return (torch.randn(*shape, V, generator=g, dtype=torch.float64) * sharp).softmax(-1)

    p1, p2, p3 = d(), d(V), d(V, V)  # target: p1(x1), p2(x2 | x1), p3(x3 | x1, x2)
    q1, q2, qb = d(), d(), d(V)  # chain q at slots 1, 2 (parallel); branch continuation q(. | alt)
    return p1, p2, p3, q1, q2, qb


def _one_draw(dists, g, walk):
    """One decode step on a tree (chain of 2 + a branch of 2 at slot 1), then plain sampling
    for whatever the step did not commit: returns the first three tokens."""
    p1, p2, p3, q1, q2, qb = dists
    d1 = int(torch.multinomial(q1, 1, generator=g))
    d2 = int(torch.multinomial(q2, 1, generator=g))
    qa = q1.clone()
    qa[d1] = 0
    qa /= qa.sum()
    a1 = int(torch.multinomial(qa, 1, generator=g))  # the alternative: q1 without the chain's token
    b2 = int(torch.multinomial(qb[a1], 1, generator=g))
    row = build_row(0, [d1, d2], [Branch(1, [a1, b2], torch.stack([qa, qb[a1]]))], torch.stack([q1, q2]))
    # target distribution after each node: node 0 -> p1, chain 1 -> p2[d1], chain 2 -> p3[d1, d2],
    # branch 3 (a1) -> p2[a1], branch 4 (b2) -> p3[a1, b2]
    tp = torch.stack([p1, p2[d1], p3[d1, d2], p2[a1], p3[a1, b2]])
    toks = walk(row, tp, g).tokens
    while len(toks) < 3:  # later steps: plain sampling from the target
        p = p1 if not toks else p2[toks[0]] if len(toks) == 1 else p3[toks[0], toks[1]]
        toks.append(int(torch.multinomial(p, 1, generator=g)))
    return tuple(toks[:3])


def _pvalue(dists, walk, n=6000, seed=0):
    p1, p2, p3 = dists[:3]
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [V, V, V]
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, V)
    for _ in range(n):
        x = _one_draw(dists, g, walk)
        counts[x] += 1
    exp = joint.flatten() * n
    obs = counts.flatten().double()
    big = exp >= 5
    obs = torch.cat([obs[big], obs[~big].sum()[None]])
    exp = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp > 0
    return chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue


def _no_residual_walk(row, target_probs, generator):
    """Known wrong: after a rejected child the next one is tested against p, not the residual."""
    kids = row.children()
    path, cur = [0], 0
    while True:
        p = target_probs[cur]
        moved = False
        for c in kids[cur]:
            x, q = row.tokens[c], row.probs[c]
            if float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x]):
                path.append(c)
                cur, moved = c, True
                break
        if not moved:
            resid = p
            last = int(torch.multinomial(resid, 1, generator=generator))
            return tree_verify.PathResult(path, [row.tokens[i] for i in path[1:]] + [last])


@pytest.mark.parametrize("seed", [1, 2])
def test_tree_sampling_follows_the_target(seed):
    dists = _dists(seed)
    assert _pvalue(dists, sampling_walk, seed=seed) > 1e-3


@pytest.mark.parametrize("seed", [1, 2])
def test_control_a_sampler_without_residuals_is_rejected(seed):
    dists = _dists(seed)
    assert _pvalue(dists, _no_residual_walk, seed=seed) < 1e-6


def test_branches_are_used():
    """The statistical test means something only if the branch is taken often."""
    dists = _dists(1)
    g = torch.Generator().manual_seed(0)
    p1, p2, p3, q1, q2, qb = dists
    wins = 0
    for _ in range(500):
        d1 = int(torch.multinomial(q1, 1, generator=g))
        qa = q1.clone()
        qa[d1] = 0
        qa /= qa.sum()
        a1 = int(torch.multinomial(qa, 1, generator=g))
        row = build_row(0, [d1, 0], [Branch(1, [a1, 0], torch.stack([qa, qb[a1]]))], torch.stack([q1, q2]))
        tp = torch.stack([p1, p2[d1], p3[d1, 0], p2[a1], p3[a1, 0]])
        wins += 3 in sampling_walk(row, tp, g).path
    assert wins > 50


def test_greedy_reads_name_the_branch_nodes_at_the_chains_stop():
    row = build_row(7, [11, 12, 13, 14], [Branch(1, [21, 22, 23]), Branch(1, [24]), Branch(3, [31, 32])])
    # nodes: 0:7 1:11 2:12 3:13 4:14 | 5:21 6:22 7:23 | 8:24 | 9:31 10:32
    assert row.chain_length == 5
    assert tree_verify.greedy_reads(row, [21, 0, 0, 0, 0]) == [5, 6, 7, 8]  # stops at node 0
    assert tree_verify.greedy_reads(row, [11, 12, 31, 0, 0]) == [9, 10]  # stops at node 2
    assert tree_verify.greedy_reads(row, [11, 0, 0, 0, 0]) == []  # stops at node 1: no branch there
    assert tree_verify.greedy_reads(row, [11, 12, 13, 14, 0]) == []  # the whole chain


def _random_row(g: torch.Generator, vocab: int = 6):
    n = int(torch.randint(1, 8, (1,), generator=g))
    chain = torch.randint(vocab, (n,), generator=g).tolist()
    branches = []
    for _ in range(int(torch.randint(0, 5, (1,), generator=g))):
        slot = int(torch.randint(1, n + 1, (1,), generator=g))
        length = int(torch.randint(1, 4, (1,), generator=g))
        first = (chain[slot - 1] + int(torch.randint(1, vocab, (1,), generator=g))) % vocab  # != the chain's
        branches.append(Branch(slot, [first] + torch.randint(vocab, (length - 1,), generator=g).tolist()))
    return build_row(int(torch.randint(vocab, (1,), generator=g)), chain, branches)


def test_a_walk_on_the_chain_and_the_greedy_reads_equals_a_walk_on_every_node():
    """The engine computes the target's argmax only at the chain's nodes and at greedy_reads;
    over random trees and targets (a small vocabulary, so walks often enter branches) the walk
    on those alone must be the walk on every node's argmax."""
    g = torch.Generator().manual_seed(5)
    entered, skipped = 0, 0
    for _ in range(3000):
        row = _random_row(g)
        full = torch.randint(6, (row.size,), generator=g).tolist()
        n = row.chain_length
        lazy = full[:n] + [-1] * (row.size - n)
        reads = tree_verify.greedy_reads(row, full[:n])
        for node in reads:
            lazy[node] = full[node]
        want = greedy_walk(row, full)
        got = greedy_walk(row, lazy)
        assert (got.path, got.tokens) == (want.path, want.tokens)
        entered += any(p >= n for p in want.path)
        skipped += row.size - n - len(reads)
    assert entered > 300 and skipped > 1000  # both cases are exercised, and the reads do save rows


def test_a_walk_that_reads_an_uncomputed_node_fails_loudly():
    row = build_row(7, [11], [Branch(1, [21, 22])])
    with pytest.raises(RuntimeError, match="not computed"):
        greedy_walk(row, [21, -1, -1, -1])
