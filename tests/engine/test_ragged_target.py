"""The target's ragged forward: every path gives each request the logits it gets alone.

Undrafted requests verify one token beside drafted ones that verify many; on the ragged path
the single-token rows share one call over the batch's cache views. A row served the wrong
mask or the wrong slot's keys shows up as a logit mismatch here.
"""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.target import hf_target
from sglang_adaflash.target.hf_target import TargetBatch


def _prefill(target, cache, prompts):
    batch = TargetBatch.from_lists(prompts, [0] * len(prompts))
    target.forward(batch, cache)


@pytest.mark.parametrize(
    "q_lens",
    [
        [1, 5, 1, 1, 3, 1],  # singles share a call, two drafted rows alone
        [4, 1, 1, 1, 1, 1],  # one probe among plain rows
        [2, 6, 3, 7, 2, 5],  # no single rows: per-request calls only
    ],
)
def test_ragged_rows_match_each_request_alone(target, q_lens):
    gen = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prompt_lens = [3, 9, 5, 12, 7, 4]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    tails = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in q_lens]
    assert hf_target._prefer_ragged_attention(q_lens, prompt_lens)

    cache = target.new_cache(len(prompts), 32)
    _prefill(target, cache, prompts)
    batch = TargetBatch.from_lists(tails, prompt_lens)
    logits, _ = target.forward(batch, cache)

    offset = 0
    for i, (prompt, tail) in enumerate(zip(prompts, tails)):
        alone = target.new_cache(1, 32)
        _prefill(target, alone, [prompt])
        want, _ = target.forward(TargetBatch.from_lists([tail], [len(prompt)]), alone)
        got = logits[offset : offset + len(tail)]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"request {i}")
        offset += len(tail)


def test_off_the_cpu_one_padded_call_serves_every_row(target, monkeypatch):
    """Where a launch costs more than padded arithmetic (CUDA), the rule never loops over rows;
    the padded call it takes instead gives each request its own logits (checked here on the CPU
    by forcing the padded path on the rows the CPU rule would serve one by one)."""
    q_lens, prompt_lens = [2, 6, 3, 7, 2, 5], [3, 9, 5, 12, 7, 4]
    assert hf_target._prefer_ragged_attention(q_lens, prompt_lens, "cpu")
    assert not hf_target._prefer_ragged_attention(q_lens, prompt_lens, "cuda")
    assert not hf_target._prefer_ragged_attention([1, 16, 1], [100, 3, 40], "cuda")

    gen = torch.Generator().manual_seed(1)
    vocab = target.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    tails = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in q_lens]
    outs, real = {}, hf_target._prefer_ragged_attention
    for device_type in ("cpu", "cuda"):
        monkeypatch.setattr(hf_target, "_prefer_ragged_attention",
                            lambda q, s, _t, dt=device_type: real(q, s, dt))
        cache = target.new_cache(len(prompts), 32)
        _prefill(target, cache, prompts)
        outs[device_type], _ = target.forward(TargetBatch.from_lists(tails, prompt_lens), cache)
    torch.testing.assert_close(outs["cuda"], outs["cpu"], rtol=1e-6, atol=1e-6)
