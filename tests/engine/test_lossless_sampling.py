"""At temperature > 0 the engine's output distribution equals the target's (chi-square)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.length_policy import StepCostModel
from sglang_adaflash.engine.request import Request
from sglang_adaflash.engine.sampling import SamplingParams, filtered_probs
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
