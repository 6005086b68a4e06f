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
