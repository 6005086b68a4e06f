"""At temperature 0, every mode commits exactly plain greedy decoding's tokens."""

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

from .conftest import OracleProposer


def _prompts(n, seed=3, lo=2, hi=14, vocab=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _hf_greedy(target, prompt, n):
    ids = torch.tensor([prompt])
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt):].tolist()


def _run(target, drafter, mode, prompts, max_new, batch, proposer=None, **kw):
    if mode == "adaflash-history":  # lengths planned from history before drafting; only those slots drafted
        mode, kw = "adaflash", {**kw, "lengths_from": "history"}
    eng = SpecEngine(target, drafter, mode=mode, max_batch_size=batch, max_seq_len=128, proposer=proposer,
                     cost_model=StepCostModel(0.01, 0.001), **kw)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new)])
    assert all(o.ok for o in outs)
    return outs


def test_ar_equals_hf_generate(target):
    prompts = _prompts(4)
    max_new = [9, 1, 17, 5]
    outs = _run(target, None, "ar", prompts, max_new, batch=4)
    for p, n, o in zip(prompts, max_new, outs):
        assert o.output_ids == _hf_greedy(target, p, n)
        assert len(o.output_ids) == n and o.finish_reason == "length"


def test_llama_target_is_lossless():
    target = tiny_target(seed=2, family="llama")
    prompts = _prompts(3, seed=4)
    max_new = [7, 12, 4]
    ar = _run(target, None, "ar", prompts, max_new, 2)
    for p, n, o in zip(prompts, max_new, ar):
        assert o.output_ids == _hf_greedy(target, p, n)
    spec = _run(target, tiny_drafter(), "adaflash", prompts, max_new, 2)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]


@pytest.mark.parametrize("mode", ["dflash", "adaflash", "adaflash-history"])
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_equals_ar_with_joins(target, drafter, mode, batch):
    """Mixed prompt and output lengths; batch < requests, so requests join mid-run."""
    prompts = _prompts(7, seed=batch)
    max_new = [12, 3, 25, 1, 8, 19, 6]
    ar = [o.output_ids for o in _run(target, None, "ar", prompts, max_new, batch)]
    spec = _run(target, drafter, mode, prompts, max_new, batch)
    assert [o.output_ids for o in spec] == ar


@pytest.mark.parametrize("mode", ["dflash", "adaflash", "adaflash-history"])
def test_partially_correct_drafts_stay_lossless(target, drafter, mode):
    """An oracle drafter with injected mistakes: many multi-token accepts, still exact."""
    prompts = _prompts(6, seed=11)
    max_new = [30, 7, 22, 15, 2, 26]
    ar = [o.output_ids for o in _run(target, None, "ar", prompts, max_new, 3)]
    prop = OracleProposer(target, drafter, error_rate=0.2)
    outs = _run(target, drafter, mode, prompts, max_new, 3, proposer=prop)
    assert [o.output_ids for o in outs] == ar
    taus = [o.stats.tau for o in outs if o.stats.steps]
    assert max(taus) > 2.0, "the oracle should get multi-token acceptances"
    for o in outs:
        st = o.stats
        assert st.committed_tokens == len(o.output_ids) - 1 or o.finish_reason == "length"
        assert all(1 <= a <= v for a, v in zip(st.accept_lens, st.verify_lens))
        assert sum(st.accepted_by_position) == sum(a - 1 for a in st.accept_lens)


def test_stop_tokens(target, drafter):
    prompts = _prompts(3, seed=5)
    ar = _run(target, None, "ar", prompts, [20, 20, 20], 3)
    stop = ar[0].output_ids[6]
    first = ar[0].output_ids.index(stop)
    eng = SpecEngine(target, drafter, mode="dflash", max_batch_size=3, max_seq_len=128,
                     proposer=OracleProposer(target, drafter, error_rate=0.0))
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=20, stop_token_ids=(stop,))) for p in prompts])
    assert outs[0].output_ids == ar[0].output_ids[: first + 1]
    assert outs[0].finish_reason == "stop"
    for o, ref in zip(outs[1:], ar[1:]):
        cut = ref.output_ids.index(stop) + 1 if stop in ref.output_ids else 20
        assert o.output_ids == ref.output_ids[:cut]


def test_paper_length_rule_is_lossless(target, drafter):
    prompts = _prompts(4, seed=8)
    max_new = [10, 14, 3, 9]
    ar = [o.output_ids for o in _run(target, None, "ar", prompts, max_new, 2)]
    outs = _run(target, drafter, "adaflash", prompts, max_new, 2, length_rule="paper")
    assert [o.output_ids for o in outs] == ar


def test_drafter_context_is_independent_of_batching(target, drafter):
    """A request's drafter states (seen through the length head) are the same alone or batched
    with joins and slot moves: a request moved into a freed slot keeps its own context."""
    prompts = _prompts(6, seed=21)
    max_new = [9, 3, 14, 5, 11, 7]  # early finishers free slots that later requests move into

    def ratios(batch):  # the raw head, every request drafted every step (same step boundaries)
        outs = _run(target, drafter, "adaflash", prompts, max_new, batch, calibrate=False, draft_off=False)
        return [o.stats.head_ratios for o in outs]

    alone, batched = ratios(1), ratios(3)
    for a, b in zip(alone, batched):
        assert len(a) == len(b)  # T=0, same drafter: the same steps
        n = len(a)
        assert torch.allclose(torch.tensor(a[:n]), torch.tensor(b[:n]), atol=1e-6)
