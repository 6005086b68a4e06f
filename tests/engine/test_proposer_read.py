"""DFlashProposer.propose with `read`: the block states of the slots read, and only those, equal
the whole block's at those slots (the drafter's `read` path, through the real context cache)."""

import pytest
import torch

from sglang_adaflash.engine.engine import SpecEngine


def _proposer_with_context(target, drafter, slots, seed):
    """A dflash engine's proposer with random context in its three cache slots, and the rows of
    `slots` (all three when None): their indices, last tokens and committed context lengths
    (each row sees its own)."""
    prop = SpecEngine(target, drafter, mode="dflash", max_batch_size=3, max_seq_len=64).proposer
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(3, 9, drafter.fc.in_features, generator=g, dtype=drafter.fc.weight.dtype)
    prop.extend_context(feats, torch.zeros(3, dtype=torch.long), [0, 1, 2])
    rows = slots or [0, 1, 2]
    return prop, rows, torch.tensor([11, 12, 13])[rows], torch.tensor([5, 9, 7])[rows]


@pytest.mark.parametrize("slots", [None, [0, 2]])  # the whole batch (a cache view), some rows (a gather)
def test_propose_reads_the_whole_blocks_states_at_the_slots_read(target, drafter, slots):
    prop, rows, last, ctx = _proposer_with_context(target, drafter, slots, seed=0)
    full = prop.propose(last, ctx, slots=slots)  # [n, B, H]
    read = torch.tensor([[1, 2], [3, 1], [5, 6]])[: len(rows)]
    part = prop.propose(last, ctx, slots=slots, read=read)
    assert part.shape == (len(rows), 2, full.shape[-1])
    want = full.gather(1, read[..., None].expand(-1, -1, full.shape[-1]))
    torch.testing.assert_close(part, want, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(part[0, 1], full[0, 1])  # slot 2, not slot 1: the slots differ


@pytest.mark.parametrize("slots", [None, [1], [0, 2]])  # the batch, one request (no mask), a gather
def test_a_slice_read_equals_the_whole_blocks_states_at_those_slots(target, drafter, slots):
    """The engine's read (block slots 1..k of every row) as a slice, by views: the states of
    the whole block at those slots. One request attends without a mask (block_inputs), which
    must equal the masked whole block's."""
    prop, rows, last, ctx = _proposer_with_context(target, drafter, slots, seed=1)
    full = prop.propose(last, ctx, slots=slots)
    embeds, positions, mask, c = prop.block_inputs(last, ctx)  # masked, whatever the batch
    assert mask is not None
    # RoPE computed, not read from the proposer's table
    states = prop.drafter(embeds, positions, prop.context(prop.cache, slots, len(rows), c), mask)
    torch.testing.assert_close(full, states, rtol=1e-9, atol=1e-9)
    part = prop.propose(last, ctx, slots=slots, read=slice(2, 5))
    assert part.shape == (len(rows), 3, full.shape[-1])
    torch.testing.assert_close(part, full[:, 2:5], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(part[:, 0], full[:, 1])
