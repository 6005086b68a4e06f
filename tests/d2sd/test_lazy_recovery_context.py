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


def test_a_retired_slot_keeps_no_queue():
    lazy, _, feat = _pair()
    lazy.extend_context(torch.randn(2, 5, feat), torch.tensor([0, 0]), [0, 1])
    lazy.release(1)
    assert list(lazy._lag) == [0]


def test_one_long_queue_costs_the_others_no_padding():
    lazy, eager, feat = _pair()
    prompt, step = torch.randn(1, 80, feat), torch.randn(2, 3, feat)
    for p in (lazy, eager):
        p.extend_context(prompt, torch.tensor([0]), [0])  # a long prompt joins
        p.extend_context(step, torch.tensor([5, 9]), [1, 2])
    calls = []
    proj = lazy.recovery.project_context
    lazy.recovery.project_context = lambda x: calls.append(tuple(x.shape)) or proj(x)
    lazy.catch_up([0, 1, 2])
    assert calls == [(1, 86, feat)]  # 80 + 3 + 3 rows, packed (padded: 3 x 80)
    for slot, n in ((0, 80), (1, 8), (2, 12)):
        _same(lazy, eager, slot, n)


@pytest.mark.parametrize("branch_drafter", ["recovery", "auto"])
def test_every_recovery_read_in_a_real_engine_sees_the_eager_cache(target, drafter, branch_drafter):
    """A real D2SDEngine (joins, retirements, freed slots refilled), its proposer mirrored by an
    eager one: at every recovery forward, each slot read equals it over the context read."""
    from sglang_adaflash.core.sampling import SamplingParams
    from sglang_adaflash.d2sd.engine import D2SDEngine
    from sglang_adaflash.engine.request import Request
    from sglang_adaflash.planner.cost import StepCostModel

    rec = recovery_for(drafter)
    eng = D2SDEngine(target, drafter, rec, tree_k=3, branch_len=3, branch_width=2, branch_drafter=branch_drafter,
                     tree_rule="fixed" if branch_drafter == "recovery" else "load_aware", max_batch_size=3,
                     max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    lazy = eng.proposer
    lazy.FLUSH_AFTER = 5
    eager = DFlashProposer(rec, num_slots=3, capacity=lazy.rcache.capacity)
    ext, mov, read = lazy.extend_context, lazy.move, lazy.propose_branches
    checked = []

    def extend(h, starts, slots):
        eager.extend_context(h, starts, slots)
        ext(h, starts, slots)

    def move(src, dst, length):
        eager.move(src, dst, length)
        mov(src, dst, length)

    def propose(ids, ctx, slots, r=None):
        out = read(ids, ctx, slots, r)
        for slot, n in zip(slots.tolist(), ctx.tolist()):
            _same(lazy, eager, slot, n)
            checked.append(slot)
        return out

    lazy.extend_context, lazy.move, lazy.propose_branches = extend, move, propose
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 90, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, [9, 1, 17, 5, 12, 3, 20, 7])])
    assert all(o.ok for o in outs)
    assert len(checked) > (20 if branch_drafter == "recovery" else 0)
    assert lazy._lag == {}  # every retired request's queue was dropped
