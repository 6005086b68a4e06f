"""The target's ragged forward: every path gives each request the logits it gets alone.

Undrafted requests verify one token beside drafted ones that verify many; on the ragged path
the single-token rows share one call over the batch's cache views. A row served the wrong
mask or the wrong slot's keys shows up as a logit mismatch here.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_adaflash.target import hf_target
from sglang_adaflash.target.hf_target import TargetBatch, pad_packed


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


class _SyncCounter(TorchDispatchMode):
    """Counts what would wait for an accelerator if these tensors lived on one: scalar reads,
    `.tolist()` (patched in by the caller), nonzero, and boolean-mask indexing."""

    def __init__(self):
        super().__init__()
        self.waits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        indices = args[1] if name.startswith("aten.index") and len(args) > 1 else ()
        if name in ("aten.nonzero", "aten._local_scalar_dense", "aten.masked_select") or any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ())
        ):
            self.waits.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("q_lens", [[1, 5, 1, 1, 3, 1], [2, 6, 3, 7, 2, 5], [1, 1, 1, 1, 1, 1]])
def test_a_forward_reads_nothing_back_and_indexes_with_no_mask(target, monkeypatch, device_type, q_lens):
    """The layout comes with the batch (host lists and a packed index), so neither attention path
    reads the device or indexes with a boolean mask: on a GPU each of those is a sync, and a
    padded batch took 2 of them a layer."""
    real = hf_target._prefer_ragged_attention
    monkeypatch.setattr(hf_target, "_prefer_ragged_attention", lambda q, s, _t: real(q, s, device_type))
    gen = torch.Generator().manual_seed(2)
    prompt_lens = [3, 9, 5, 12, 7, 4]
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    tails = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in q_lens]
    cache = target.new_cache(len(prompts), 32)
    _prefill(target, cache, prompts)
    batch = TargetBatch.from_lists(tails, prompt_lens)
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    with _SyncCounter() as counter:
        logits, aux = target.forward(batch, cache)
        padded = pad_packed(logits, batch)
    assert counter.waits == [] and reads == []
    assert padded.shape == (len(q_lens), max(q_lens), target.vocab_size)


def test_pad_packed_puts_each_row_where_a_mask_would(target):
    q_lens = [2, 6, 1, 4]
    batch = TargetBatch.from_lists([[7] * n for n in q_lens], [0, 0, 0, 0])
    flat = torch.arange(sum(q_lens) * 3, dtype=torch.float32).view(-1, 3)
    want = torch.zeros(4, 6, 3)
    want[batch.valid] = flat
    assert torch.equal(pad_packed(flat, batch), want)
    # a batch built without host layout (device tensors only) derives the same index
    bare = TargetBatch(batch.input_ids, batch.starts, batch.q_lens)
    assert torch.equal(pad_packed(flat, bare), want)
    uniform = TargetBatch.from_lists([[1, 2], [3, 4]], [5, 6])
    assert uniform.packed_index is None and pad_packed(flat[:4], uniform).data_ptr() == flat.data_ptr()


def test_proposals_kept_on_the_device_verify_as_the_same_tokens(target):
    """from_device_ids (row i: first[i], then rest[i, :q_len - 1]) is from_lists of those tokens."""
    gen = torch.Generator().manual_seed(3)
    prompt_lens, q_lens = [4, 8, 6], [3, 1, 5]
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    first = [11, 12, 13]
    rest = torch.randint(0, target.vocab_size, (3, 6), generator=gen)  # wider than needed
    tokens = [[f] + rest[i, : n - 1].tolist() for i, (f, n) in enumerate(zip(first, q_lens))]
    outs = []
    for batch in (TargetBatch.from_lists(tokens, prompt_lens),
                  TargetBatch.from_device_ids(first, rest, q_lens, prompt_lens, "cpu")):
        cache = target.new_cache(3, 32)
        _prefill(target, cache, prompts)
        outs.append(target.forward(batch, cache)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
