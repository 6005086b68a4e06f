"""The recovery drafter's context cache is filled lazily (TreeProposer): whenever it is read, it
must hold what eager writes of the same extend_context calls would have left at every committed
position, through padded rows, rollbacks, slot moves, new requests in a slot and forced flushes."""

import pytest
import torch

from sglang_adaflash.d2sd.recovery_drafter import TreeProposer
from sglang_adaflash.engine.proposer import DFlashProposer
from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

from .conftest import recovery_for

SLOTS, CAP = 3, 96


def _pair():
    first = tiny_drafter(seed=1)
    rec = recovery_for(first, seed=5)
    lazy = TreeProposer(first, rec, num_slots=SLOTS, capacity=CAP)
    eager = DFlashProposer(rec, num_slots=SLOTS, capacity=CAP)  # writes the recovery drafter's K/V at once
    return lazy, eager, first.fc.in_features


def _same(lazy, eager, slot, length):
    for layer in range(len(lazy.rcache.k)):
        torch.testing.assert_close(lazy.rcache.k[layer][slot, :, :length], eager.cache.k[layer][slot, :, :length],
                                   rtol=1e-9, atol=1e-10)  # batched differently: round-off only
        torch.testing.assert_close(lazy.rcache.v[layer][slot, :, :length], eager.cache.v[layer][slot, :, :length],
                                   rtol=1e-9, atol=1e-10)  # batched differently: round-off only


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("flush_after", [3, 64])
def test_lazy_cache_equals_eager_writes_wherever_read(seed, flush_after):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    lazy, eager, feat = _pair()
    lazy.FLUSH_AFTER = flush_after
    committed = [0] * SLOTS

    def extend(slots, starts, width):
        x = torch.randn(len(slots), width, feat, generator=g)  # rows past each slot's commit are padding
        for p in (lazy, eager):
            p.extend_context(x, torch.tensor(starts), slots)

    def prefill(slot):
        n = int(torch.randint(2, 12, (1,), generator=g))
        extend([slot], [0], n)
        committed[slot] = n

    for slot in range(SLOTS):
        prefill(slot)
    reads = 0
    for step in range(60):
        rows = list(range(SLOTS)) if step % 3 else [2, 0]  # the whole batch, or some rows out of order
        width = int(torch.randint(1, 6, (1,), generator=g))
        extend(rows, [committed[s] for s in rows], width)
        for s in rows:
            committed[s] += int(torch.randint(1, width + 1, (1,), generator=g))
        if step % 7 == 3:  # the request in slot 0 leaves: the last one moves into its slot
            for p in (lazy, eager):
                p.move(SLOTS - 1, 0, committed[SLOTS - 1])
            committed[0] = committed[SLOTS - 1]
            prefill(SLOTS - 1)  # and a new request takes the freed slot
        if step % 5 == 4:  # a recovery forward reads some slots
            read = [s for s in range(SLOTS) if torch.rand(1, generator=g) < 0.6]
            lazy.catch_up(read)
            for s in read:
                _same(lazy, eager, s, committed[s])
                reads += 1
        if max(committed) > CAP - 10:
            break
    lazy.catch_up(range(SLOTS))
    for s in range(SLOTS):
        _same(lazy, eager, s, committed[s])
    assert reads > 5
    if flush_after == 3:
        assert lazy.lag_flushes > 10  # the bound forced flushes between reads too


def test_nothing_is_projected_until_read():
    lazy, _, feat = _pair()
    target = tiny_target()
    lazy.recovery.share_target_modules(target.embed_tokens, target.lm_head)
    lazy.extend_context(torch.randn(2, 7, feat), torch.tensor([0, 0]), [0, 1])
    for step in range(10):
        lazy.extend_context(torch.randn(2, 3, feat), torch.tensor([7 + 2 * step] * 2), [0, 1])
    assert lazy.lag_flushes == 0
    assert all(float(k.abs().sum()) == 0 for k in lazy.rcache.k)
    ids = torch.full((1, lazy.block_size), lazy.mask_token_id)
    lazy.propose_branches(ids, torch.tensor([27]), torch.tensor([1]))  # reads slot 1 only
    assert lazy.lag_flushes == 1 and list(lazy._lag) == [0]
    assert float(lazy.rcache.k[0][1].abs().sum()) > 0 and float(lazy.rcache.k[0][0].abs().sum()) == 0


def test_an_empty_extension_drops_nothing_queued():
    lazy, eager, feat = _pair()
    x = torch.randn(1, 6, feat)
    for p in (lazy, eager):
        p.extend_context(x, torch.tensor([0]), [0])
        p.extend_context(torch.randn(1, 0, feat), torch.tensor([3]), [0])
    lazy.catch_up([0])
    _same(lazy, eager, 0, 6)
