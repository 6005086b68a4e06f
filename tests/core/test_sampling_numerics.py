"""Sampling is numerically safe for every temperature and top_p the API accepts.

A temperature of 1e-38 made float32 logits / T infinite, 1e-300 rounded to 0 and made them NaN,
and a top_p of 1e-300 rounded to 0 and dropped every token: multinomial then raised in the
middle of a step. Temperatures below SAMPLING_EPS decode greedily; filtered_probs clamps what it
divides by and always keeps the most likely token.
"""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.core.sampling import (
    SAMPLING_EPS,
    SamplingParams,
    filtered_probs,
    sample_from,
)

V = 300  # past PARTIAL_TOP, so both the windowed and the sorted top-p paths run


def _logits(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(n, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4).to(dtype)


def _col(value, n, dtype):
    return torch.full((n,), value, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-300, 5e-324, SAMPLING_EPS, 0.7, 1e30, 1e300, 1.7e308])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (5, 1.0), (5, 0.5), (0, 1e-300), (0, 1e-46)])
def test_filtered_probs_is_a_distribution_for_every_accepted_setting(dtype, temperature, top_k, top_p):
    n = 3
    # float64 temperatures as the engine builds them (then cast to float32 inside)
    probs = filtered_probs(_logits(n, dtype=dtype), _col(temperature, n, torch.float64),
                           _col(top_k, n, torch.long), _col(top_p, n, torch.float32))
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(n), atol=1e-5, rtol=0)
    assert sample_from(probs, torch.Generator().manual_seed(0)).shape == (n,)


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-9])
@pytest.mark.parametrize("top_k", [0, 7])
def test_a_vanishing_top_p_keeps_exactly_the_most_likely_token(top_p, top_k):
    logits = _logits(4, seed=1)
    probs = filtered_probs(logits, _col(1.0, 4, torch.float32), _col(top_k, 4, torch.long),
                           _col(top_p, 4, torch.float32))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_a_vanishing_temperature_is_greedy_and_recorded_as_0():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=SAMPLING_EPS / 2).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    sp = SamplingParams(temperature=1e-38, top_k=10**30, top_p=0.5).canonical(vocab_size=V)
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.0, 0, 0.5)
    same = SamplingParams(temperature=0.8, top_k=V - 1)
    assert same.canonical(V) == same
