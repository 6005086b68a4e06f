"""The shared rejection sampler on mixed batches: greedy and sampled rows, ragged verify
lengths, per-row filters and per-row random streams, all in one call over one SpecMetadata."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from sglang_adaflash.core.rejection import PLACEHOLDER, RejectionSampler, verify_greedy
from sglang_adaflash.core.sampling import filtered_probs
from sglang_adaflash.core.spec_metadata import RowSampling, SpecMetadata

V, K = 6, 4  # a small vocabulary, so every position's distribution is checked cell by cell
FILTERS = [(0.7, 3, 1.0), (1.0, 0, 0.9)]  # (temperature, top-k, top-p) of the two sampled kinds


def _batch(n_sampled: int, seed: int, lengths_sampled: int = K + 1, wrong_q: bool = False):
    """Rows 0-1 greedy (lengths 5 and 2), then n_sampled sampled rows alternating between the two
    filters. The target's logits at slot j do not depend on the tokens before it (a valid, if
    memoryless, target), so the committed token at position j must follow filtered p_j."""
    g = torch.Generator().manual_seed(seed)
    bs = 2 + n_sampled
    target_logits = torch.randn(K + 1, V, generator=torch.Generator().manual_seed(7)) * 1.5
    draft_logits = torch.randn(K, V, generator=torch.Generator().manual_seed(8)) * 1.5
    sampled = list(range(2, bs))
    kinds = [i % 2 for i in range(n_sampled)]
    temp = torch.tensor([FILTERS[k][0] for k in kinds])
    top_k = torch.tensor([FILTERS[k][1] for k in kinds])
    top_p = torch.tensor([FILTERS[k][2] for k in kinds])
    q = filtered_probs(draft_logits.repeat(n_sampled, 1), temp.repeat_interleave(K),
                       top_k.repeat_interleave(K), top_p.repeat_interleave(K)).view(n_sampled, K, V)
    draft_ids = torch.zeros(bs, K, dtype=torch.long)
    draft_ids[:2] = target_logits[:K].argmax(-1)  # greedy rows: the target's own choices...
    draft_ids[1, 0] = (draft_ids[1, 0] + 1) % V  # ...except row 1's first, which is rejected
    draft_ids[2:] = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(n_sampled, K)
    if wrong_q:  # the bug mutation testing found: every slot's q written from slot 0's
        q = q[:, :1].expand(-1, K, -1).contiguous()
    lengths = torch.tensor([K + 1, 2] + [lengths_sampled] * n_sampled)
    meta = SpecMetadata(lengths, draft_ids, q, sampled, RowSampling(temp, top_k, top_p))
    return meta, target_logits.expand(bs, -1, -1).contiguous(), kinds


def _expected(kind: int) -> torch.Tensor:
    t, k, p = FILTERS[kind]
    logits = torch.randn(K + 1, V, generator=torch.Generator().manual_seed(7)) * 1.5
    n = K + 1
    return filtered_probs(logits, torch.full((n,), t), torch.full((n,), k), torch.full((n,), p))


def _position_pvalues(wrong_q: bool) -> list[float]:
    counts = torch.zeros(2, K + 1, V)
    for seed in range(4):
        meta, logits, kinds = _batch(20_000, seed, wrong_q=wrong_q)
        res = RejectionSampler(torch.Generator().manual_seed(100 + seed)).verify(meta, logits)
        toks, acc = res.tokens[2:], res.num_accepted[2:]
        for j in range(K + 1):
            reached = acc >= j
            for kind in (0, 1):
                sel = reached & (torch.tensor(kinds) == kind)
                counts[kind, j] += torch.bincount(toks[sel, j], minlength=V).double()
    out = []
    for kind in (0, 1):
        exp = _expected(kind)
        for j in range(K + 1):
            obs = counts[kind, j]
            keep = exp[j] > 0
            assert obs[~keep].sum() == 0, f"a filtered-out token was committed at position {j}"
            e = exp[j][keep] / exp[j][keep].sum() * obs[keep].sum()
            out.append(chisquare(obs[keep].numpy(), e.numpy()).pvalue)
    return out


@pytest.mark.parametrize("wrong_q", [False, True])
def test_every_position_of_a_sampled_row_follows_the_filtered_target(wrong_q):
    """Positions 0..K (K proposals and the bonus) for two filters side by side; control: q read
    from the wrong slot must be rejected."""
    pvalues = _position_pvalues(wrong_q)
    if wrong_q:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3 / len(pvalues), pvalues


def test_greedy_rows_in_a_mixed_batch_verify_as_alone():
    meta, logits, _ = _batch(6, seed=0, lengths_sampled=3)
    res = RejectionSampler(torch.Generator().manual_seed(0)).verify(meta, logits)
    alone = verify_greedy(meta.draft_ids[:2], logits[:2], meta.lengths[:2] - 1)
    assert torch.equal(res.tokens[:2], alone.tokens) and torch.equal(res.num_accepted[:2],
                                                                     alone.num_accepted)
    assert res.to_lists()[:2] == [logits[0].argmax(-1).tolist(), [int(logits[1, 0].argmax())]]
    # ragged: a sampled row of length 3 commits at most 3 tokens, padded past them
    assert int(res.num_accepted[2:].max()) <= 2
    assert (res.tokens[2:, 3:] == PLACEHOLDER).all()


def test_a_seeded_row_draws_the_same_whatever_its_companions():
    def run(n_sampled: int, seed_other: int) -> list[int]:
        meta, logits, _ = _batch(n_sampled, seed=3)
        gens = [torch.Generator().manual_seed(seed_other + i) for i in range(n_sampled)]
        gens[0] = torch.Generator().manual_seed(42)  # row 2: the seeded request
        meta.sampling.generators = gens
        res = RejectionSampler(torch.Generator().manual_seed(seed_other)).verify(meta, logits)
        return res.to_lists()[2]

    alone, crowded = run(1, 0), run(9, 5)
    assert alone == crowded
    # control: without its own stream the same row depends on the batch's shared stream
    meta, logits, _ = _batch(1, seed=3)
    draws = {tuple(RejectionSampler(torch.Generator().manual_seed(s)).verify(meta, logits)
                   .to_lists()[2]) for s in range(20)}
    assert len(draws) > 1


def test_a_plain_step_samples_its_bonus_token_from_the_filtered_target():
    n = 40_000
    logits = torch.randn(1, 1, V, generator=torch.Generator().manual_seed(1)).expand(n, 1, V)
    meta = SpecMetadata.plain(n, "cpu")
    meta.sampled = list(range(n))
    meta.sampling = RowSampling(torch.full((n,), 0.8), torch.full((n,), 4, dtype=torch.long),
                                torch.ones(n))
    res = RejectionSampler(torch.Generator().manual_seed(2)).verify(meta, logits.contiguous())
    p = filtered_probs(logits[:1, 0], torch.tensor([0.8]), torch.tensor([4]), torch.ones(1))[0]
    obs = torch.bincount(res.tokens[:, 0], minlength=V).double()
    keep = p > 0
    assert obs[~keep].sum() == 0
    assert chisquare(obs[keep].numpy(), (p[keep] / p[keep].sum() * n).numpy()).pvalue > 1e-4


@pytest.mark.parametrize("break_it,needle", [
    (lambda m: setattr(m, "lengths", m.lengths.float()), "long tensor"),
    (lambda m: setattr(m, "lengths", m.lengths - 5), ">= 1"),
    (lambda m: setattr(m, "draft_ids", m.draft_ids[:, :1]), "draft_ids"),
    (lambda m: setattr(m, "sampled", [3, 2]), "distinct rows"),
    (lambda m: setattr(m, "sampling", None), "filter for every sampled row"),
    (lambda m: setattr(m, "draft_probs", None), "draft_probs"),
])
def test_metadata_that_disagrees_with_itself_is_refused(break_it, needle):
    meta, _, _ = _batch(2, seed=0)
    meta.check(vocab_size=V)
    break_it(meta)
    with pytest.raises(ValueError, match=needle):
        meta.check(vocab_size=V)
