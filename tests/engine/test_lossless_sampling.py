"""At temperature > 0 the engine's output distribution equals the target's (chi-square)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from sglang_adaflash.core.sampling import SamplingParams, filtered_probs
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

VOCAB = 6
PROMPT = [1, 4, 2]


def _exact_joint(target, sp: SamplingParams, n_tokens: int) -> dict[tuple, float]:
    """P(o_1..o_n | prompt) of plain sampling from the target, by enumeration."""
    def dist(prefix):
        with torch.no_grad():
            logits = target.model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:]
        t = torch.tensor([sp.temperature])
        return filtered_probs(logits, t, torch.tensor([sp.top_k]), torch.tensor([sp.top_p]))[0].double()

    joint = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for prefix, pr in joint.items():
            d = dist(prefix)
            for tok in range(VOCAB):
                if d[tok] > 0:
                    nxt[prefix + (tok,)] = pr * float(d[tok])
        joint = nxt
    return joint


def _chi_square(samples: list[tuple], joint: dict[tuple, float]) -> float:
    n = len(samples)
    counts = {k: 0 for k in joint}
    for s in samples:
        assert s in counts, f"sampled {s}, which the target gives probability 0"
        counts[s] += 1
    # pool cells whose expected count is below 5 into one bucket
    obs, exp, pooled_o, pooled_e = [], [], 0, 0.0
    for k, p in joint.items():
        if p * n < 5:
            pooled_o += counts[k]
            pooled_e += p * n
        else:
            obs.append(counts[k])
            exp.append(p * n)
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    total = sum(exp)
    exp = [e * n / total for e in exp]
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize(
    "mode, sp",
    [
        ("dflash", SamplingParams(temperature=1.0, max_new_tokens=3)),
        ("adaflash", SamplingParams(temperature=0.7, top_k=4, top_p=0.9, max_new_tokens=3)),
    ],
)
def test_engine_output_distribution_matches_target(mode, sp):
    target = tiny_target(seed=5, vocab=VOCAB, layers=2)
    drafter = tiny_drafter(seed=6, vocab=VOCAB, block_size=4, target_layers=2)
    eng = SpecEngine(target, drafter, mode=mode, max_batch_size=64, max_seq_len=32, seed=123,
                     cost_model=StepCostModel(0.01, 0.001), calibrate=False, draft_off=False)
    n = 4000
    outs = eng.run([Request(list(PROMPT), sp) for _ in range(n)])
    samples = [tuple(o.output_ids[:3]) for o in outs]
    assert all(len(s) == 3 for s in samples)
    multi = sum(1 for o in outs for a in o.stats.accept_lens if a > 1)
    assert multi > 100, "speculative steps must accept drafts for this test to mean anything"
    joint = _exact_joint(target, sp, 3)
    assert _chi_square(samples, joint) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    """The check above can fail: samples from another distribution are rejected."""
    target = tiny_target(seed=5, vocab=VOCAB, layers=2)
    sp = SamplingParams(temperature=1.0, max_new_tokens=3)
    joint = _exact_joint(target, sp, 3)
    keys = list(joint)
    g = torch.Generator().manual_seed(0)
    uniform = [keys[i] for i in torch.randint(0, len(keys), (4000,), generator=g).tolist()]
    assert _chi_square(uniform, joint) < 1e-6
    assert len(list(itertools.islice(joint, 3))) == 3


# -- every verified position, past whole blocks -------------------------------------------

BLOCK = 4
NEW = BLOCK + 2  # past one whole block: positions 2..B-1 of a step are verified too


def _conditional_pvalues(target, sp: SamplingParams, samples: list[tuple], min_group=25) -> list[float]:
    """Per output position t: do the samples follow p(o_t | prompt, o_<t)? One pooled
    chi-square per position over every prefix seen at least min_group times."""
    from scipy.stats import chi2

    cache: dict[tuple, torch.Tensor] = {}

    def dist(prefix):
        if prefix not in cache:
            with torch.no_grad():
                logits = target.model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:]
            t = torch.tensor([sp.temperature])
            cache[prefix] = filtered_probs(logits, t, torch.tensor([sp.top_k]), torch.tensor([sp.top_p]))[0].double()
        return cache[prefix]

    out = []
    for t in range(NEW):
        groups: dict[tuple, list[int]] = {}
        for s in samples:
            groups.setdefault(s[:t], []).append(s[t])
        stat, dof, impossible = 0.0, 0, False
        for prefix, toks in groups.items():
            if len(toks) < min_group:
                continue
            p = dist(prefix)
            counts = torch.bincount(torch.tensor(toks), minlength=VOCAB).double()
            impossible |= bool(counts[p == 0].sum() > 0)  # a token the target never emits there
            exp = p * len(toks)
            big = exp >= 5
            obs_c = torch.cat([counts[big], counts[~big].sum()[None]])
            exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
            keep = exp_c > 0
            stat += float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
            dof += int(keep.sum()) - 1
        assert dof > 0, f"position {t}: no prefix seen {min_group} times"
        out.append(0.0 if impossible else float(chi2.sf(stat, dof)))
    return out


def _always_accept(draft_ids, q, p, num_candidates, generator=None):
    """A known-wrong rejection sampler: keeps every proposal, then draws the bonus from p."""
    from sglang_adaflash.core.rejection import _assemble

    accepted = num_candidates.clone()
    last_p = p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    last = torch.multinomial(last_p, 1, generator=generator).squeeze(-1)
    return _assemble(draft_ids, accepted, last)


def _engine_samples(mode, sp, n=5000, **kw):
    if mode == "adaflash-history":  # lengths planned from history before drafting; only those slots drafted
        mode, kw = "adaflash", {**kw, "lengths_from": "history"}
    target = tiny_target(seed=5, vocab=VOCAB, layers=2)
    drafter = tiny_drafter(seed=6, vocab=VOCAB, block_size=BLOCK, target_layers=2)
    # verified tokens nearly free: whole blocks are worth verifying, so every position is reached
    eng = SpecEngine(target, drafter, mode=mode, max_batch_size=64, max_seq_len=32, seed=321,
                     cost_model=StepCostModel(1.0, 1e-6), **kw)
    greedy = SamplingParams(max_new_tokens=NEW)
    reqs = [Request(list(PROMPT), greedy if i % 10 == 0 else sp) for i in range(n)]  # mixed batches
    outs = eng.run(reqs)
    samples = [tuple(o.output_ids) for o, r in zip(outs, reqs) if not r.sampling.greedy]
    greedy_outs = {tuple(o.output_ids) for o, r in zip(outs, reqs) if r.sampling.greedy}
    deep = sum(1 for o in outs for a in o.stats.accept_lens if a >= BLOCK)
    return target, samples, greedy_outs, deep


@pytest.mark.parametrize("mode", ["dflash", "adaflash", "adaflash-history"])
@pytest.mark.parametrize("wrong", [False, True])
def test_every_verified_position_follows_the_target(mode, wrong, monkeypatch):
    """Whole blocks accepted (proposals 1..B-1 and the bonus), greedy rows in the same batches;
    the conditional distribution at each of the B+2 positions is the target's. Control
    (wrong=True): an always-accepting sampler is rejected."""
    if wrong:
        monkeypatch.setattr("sglang_adaflash.core.rejection.verify_sampling", _always_accept)
        monkeypatch.setattr("sglang_adaflash.core.flashinfer_sampling.available", lambda device: False)
    sp = SamplingParams(temperature=0.6, top_k=3, max_new_tokens=NEW)
    target, samples, greedy_outs, deep = _engine_samples(mode, sp)
    assert deep > 200, "whole blocks must be accepted for the deep positions to be checked"
    assert len(greedy_outs) == 1  # every greedy row, in any batch mix, gives the same tokens
    pvalues = _conditional_pvalues(target, sp, samples)
    if wrong:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-4 / NEW, pvalues
