"""The verifier three ways: hand-made greedy tables, seeded determinism, and statistics."""

import pytest
import torch
from scipy.stats import chisquare

from sglang_adaflash.core.rejection import PLACEHOLDER, verify_greedy, verify_sampling
from sglang_adaflash.core.sampling import filtered_probs


def _logits_for(argmaxes, vocab=6):
    """[bs, K+1, V] logits whose argmax at each slot is given."""
    t = torch.tensor(argmaxes)
    return torch.nn.functional.one_hot(t, vocab).float() * 5


@pytest.mark.parametrize(
    "draft, target_argmax, n_cand, accepted, committed",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [1, 5, 3, 4], 3, 1, [1, 5]),  # first rejection at proposal 2 -> recovered 5
        ([0, 2, 3], [1, 2, 3, 4], 3, 0, [1]),  # immediate rejection
        ([1, 2, 3], [1, 2, 3, 4], 2, 2, [1, 2, 3]),  # ragged: only 2 candidates checked
        ([1, 2, 3], [1, 2, 3, 4], 0, 0, [1]),  # verify length 1 = plain decoding
    ],
)
def test_greedy_table(draft, target_argmax, n_cand, accepted, committed):
    res = verify_greedy(torch.tensor([draft]), _logits_for([target_argmax]), torch.tensor([n_cand]))
    assert res.num_accepted.tolist() == [accepted]
    assert res.to_lists() == [committed]
    assert res.tokens.shape == (1, 4)
    assert (res.tokens[0, len(committed):] == PLACEHOLDER).all()


def test_greedy_batch_rows_are_independent():
    draft = torch.tensor([[1, 2, 3], [4, 4, 4]])
    logits = _logits_for([[1, 2, 0, 5], [4, 4, 4, 1]])
    res = verify_greedy(draft, logits, torch.tensor([3, 2]))
    assert res.to_lists() == [[1, 2, 0], [4, 4, 4]]


def _pvalue(observed, probs):
    """Chi-square goodness of fit of counts against a distribution."""
    observed = observed.double()
    expected = probs.double() / probs.double().sum() * observed.sum()
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def _markov(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(vocab, generator=g), -1)
    p2 = torch.softmax(torch.randn(vocab, vocab, generator=g), -1)  # p2[x1] = p(x2 | x1)
    return p1, p2


def _two_token_samples(n, vocab, q1, q2, p1, p2, seed, top=None):
    """Rows of a 2-proposal block; returns the first two committed tokens of every row."""
    g = torch.Generator().manual_seed(seed)
    d1 = torch.multinomial(q1.expand(n, -1), 1, generator=g).squeeze(1)
    d2 = torch.multinomial(q2.expand(n, -1), 1, generator=g).squeeze(1)
    # target probs at slot 0 (predicts x1), slot 1 (x2 | d1), slot 2 (unused here: p2[d2])
    tp = torch.stack([p1.expand(n, -1), p2[d1], p2[d2]], dim=1)
    dp = torch.stack([q1.expand(n, -1), q2.expand(n, -1)], dim=1)
    res = verify_sampling(torch.stack([d1, d2], 1), dp, tp, torch.full((n,), 2), generator=g)
    toks = res.tokens
    first = toks[:, 0]
    second = torch.where(res.num_accepted >= 1, toks[:, 1], PLACEHOLDER)
    return first, second, res


def test_sampling_first_token_and_joint_match_target():
    vocab, n = 5, 200_000
    p1, p2 = _markov(vocab, 0)
    q1 = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(9)), -1)
    q2 = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(10)), -1)
    first, second, res = _two_token_samples(n, vocab, q1, q2, p1, p2, seed=1)
    # first committed token ~ p1
    counts = torch.bincount(first, minlength=vocab).double()
    assert _pvalue(counts, p1) > 1e-3
    # when a second token was committed in the same step it must follow p(x2 | x1): the joint of
    # (x1, x2) over those rows, reweighted by P(continue | x1) = P(d1 accepted | x1), is p1 * p2
    keep = second >= 0
    pairs = first[keep] * vocab + second[keep]
    joint = torch.bincount(pairs, minlength=vocab * vocab).double().view(vocab, vocab)
    for x1 in range(vocab):
        row = joint[x1]
        if row.sum() < 500:
            continue
        assert _pvalue(row, p2[x1]) > 1e-3
    assert 0.2 < res.num_accepted.float().mean() < 1.8  # both accepts and rejections happen


def test_sampling_with_topk_topp_follows_filtered_target():
    vocab, n = 8, 200_000
    g = torch.Generator().manual_seed(4)
    tl, dl = torch.randn(2, vocab, generator=g), torch.randn(2, vocab, generator=g)
    one = torch.ones(1)
    p = filtered_probs(tl, one.expand(2) * 0.8, torch.tensor([4, 4]), torch.tensor([0.9, 0.9]))
    q = filtered_probs(dl, one.expand(2) * 0.8, torch.tensor([4, 4]), torch.tensor([0.9, 0.9]))
    p2 = p[1].expand(vocab, -1)  # x2 independent of x1 in this check
    first, _, _ = _two_token_samples(n, vocab, q[0], q[1], p[0], p2, seed=2)
    counts = torch.bincount(first, minlength=vocab).double()
    support = p[0] > 0
    assert counts[~support].sum() == 0, "a token outside top-k/top-p was emitted"
    assert _pvalue(counts[support], p[0][support]) > 1e-3


def test_sampling_is_deterministic_when_seeded():
    vocab = 6
    p1, p2 = _markov(vocab, 3)
    q = torch.full((vocab,), 1 / vocab)
    a = _two_token_samples(1000, vocab, q, q, p1, p2, seed=7)[2].tokens
    b = _two_token_samples(1000, vocab, q, q, p1, p2, seed=7)[2].tokens
    assert torch.equal(a, b)


def test_filtered_probs_topk_topp():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    t = torch.ones(1)
    p = filtered_probs(logits, t, torch.tensor([2]), torch.ones(1))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = filtered_probs(logits, t, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.allclose(p, torch.tensor([[0.5 / 0.75, 0.25 / 0.75, 0, 0]]))
    p = filtered_probs(logits, t, torch.tensor([0]), torch.tensor([0.4]))
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]))


def _bonus_samples(n, vocab, seed, slot_probs):
    """Rows whose 2 proposals are always accepted (q = p): what is drawn after them?"""
    g = torch.Generator().manual_seed(seed)
    p = slot_probs.expand(n, -1, -1)  # [n, 3, V]: slots 0, 1 predict proposals 1, 2; slot 2 the bonus
    d1 = torch.multinomial(p[:, 0], 1, generator=g).squeeze(1)
    d2 = torch.multinomial(p[:, 1], 1, generator=g).squeeze(1)
    res = verify_sampling(torch.stack([d1, d2], 1), p[:, :2], p, torch.full((n,), 2), generator=g)
    assert (res.num_accepted == 2).all()
    return res.tokens[:, 2]


def test_sampling_bonus_comes_from_the_slot_after_the_last_proposal():
    vocab, n = 6, 50_000
    g = torch.Generator().manual_seed(8)
    slot_probs = torch.softmax(torch.randn(3, vocab, generator=g) * 2, -1)
    bonus = _bonus_samples(n, vocab, 1, slot_probs)
    counts = torch.bincount(bonus, minlength=vocab).double()
    assert _pvalue(counts, slot_probs[2]) > 1e-3
    # control: the same check rejects a bonus drawn from the wrong slot
    assert _pvalue(counts, slot_probs[1]) < 1e-6
    greedy = verify_greedy(torch.tensor([[1, 2]]), _logits_for([[1, 2, 5]]), torch.tensor([2]))
    assert greedy.to_lists() == [[1, 2, 5]]  # greedy bonus: the argmax at slot K
