"""The start-up step-cost profile (engine.sizing.profile_step_cost) prices a verified token at the
shapes a verify has: one request over a cached context, between 2 tokens and a whole block.

The target here is a stand-in whose forward advances a fake clock by a known price, different for
a prefill (a forward from position 0) and a verify (over a cached context), with a jump for
leaving the single-token path: the profile must read the verify's slope and a plain step's price,
not the prefill's slope, nor the jump.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_adaflash.engine import sizing

MS = 1e-3
PLAIN, JUMP, VERIFY_PER_TOKEN = 3.0 * MS, 1.0 * MS, 0.2 * MS  # a verify over a context
PREFILL_FIXED, PREFILL_PER_TOKEN = 5.0 * MS, 0.1 * MS  # a forward from position 0


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self, device=None) -> float:
        return self.now


class _PricedTarget:
    """Each forward advances the clock by its price; records the shapes it was given."""

    def __init__(self, clock: _Clock):
        self.clock, self.shapes = clock, []

    def new_cache(self, num_slots: int, capacity: int):
        return SimpleNamespace(num_slots=num_slots, capacity=capacity)

    def forward(self, batch, cache, logits_rows=None):
        q, start = int(batch.q_lens[0]), int(batch.starts[0])
        assert start + q <= cache.capacity, "the profile's scratch cache must hold its forwards"
        self.shapes.append((start, q))
        if start == 0:
            self.clock.now += PREFILL_FIXED + PREFILL_PER_TOKEN * q
        else:
            self.clock.now += PLAIN + (JUMP if q > 1 else 0.0) + VERIFY_PER_TOKEN * (q - 1)
        return None, None


@pytest.fixture
def profiled(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(sizing, "synced_time", clock)
    target = _PricedTarget(clock)
    engine = SimpleNamespace(target=target, drafter=None, proposer=None, block_size=16,
                             device=torch.device("cpu"), max_batch_size=1)
    return engine, target


def test_a_verified_token_is_priced_at_the_verify_slope_not_the_prefill_slope(profiled):
    engine, target = profiled
    cost = sizing.profile_step_cost(engine)
    assert cost.per_token == pytest.approx(VERIFY_PER_TOKEN)  # prefill-sized forwards read 0.1 ms
    # a plain step (one verified token) costs what a one-token verify took; the jump to 2 tokens
    # is not in the per-token price
    assert cost.fixed + cost.per_token == pytest.approx(PLAIN)
    timed = {q for start, q in target.shapes if start > 0}
    assert timed == {1, 2, 16}, timed  # a block's worth, and the two shapes below it


def test_the_profile_reads_the_verify_shapes_of_the_engines_block(profiled):
    engine, target = profiled
    engine.block_size = 8
    sizing.profile_step_cost(engine)
    assert max(q for start, q in target.shapes if start > 0) == 8
