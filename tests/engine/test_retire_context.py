"""A finished request's slot is refilled by moving the batch's last request into it: the
drafter's context of the moved request, its queued backlog and a cold request's waiting prompt
must all survive the move (a wrong context only lowers acceptance, which no T=0 equality test
can see, so it is checked position by position here)."""

from __future__ import annotations

import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request

# DEAR_DRAFTS: drafting never pays at its price, so rows run plain, queue their context and are
# drafted on first reads and probes only: most rows hold a backlog when another request finishes
from .test_adaptive import DEAR_DRAFTS
from .test_lossless_greedy import _prompts


def _contexts(eng: SpecEngine) -> dict[str, tuple[int, list]]:
    """Every running request's drafter context after a full catch-up: id -> (length, per layer K/V)."""
    eng._catch_up(eng.running, list(range(len(eng.running))))
    cache = eng.proposer.cache
    return {s.req.request_id: (s.cache_len, [cache.view(layer, 1, s.cache_len, offset=i)
                                             for layer in range(len(cache.k))])
            for i, s in enumerate(eng.running)}


def _reference(target, drafter, prompt: list[int], length: int):
    """One request alone, its prompt projected at once and every token fed to the drafter as it
    commits, run until its context holds at least `length` positions."""
    eng = SpecEngine(target, drafter, mode="dflash", max_batch_size=1, max_seq_len=200)
    eng.submit(Request(prompt, SamplingParams(max_new_tokens=200 - len(prompt) - 16), "ref"))
    while not eng.running or eng.running[0].cache_len < length:
        assert eng.has_unfinished(), "the reference request ended early"
        eng.step()
    return _contexts(eng)["ref"]


def test_a_moved_requests_drafter_context_survives_the_move(target, drafter):
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=4, max_seq_len=200,
                     cost_model=DEAR_DRAFTS, probe_every=4)
    moves: list[tuple[int, bool]] = []  # (the mover's queued backlog, whether its prompt waits)
    move = eng.proposer.move

    def spy(src, dst, length):
        if src != dst:
            mover = eng.running[src]
            moves.append((mover.pending, mover.prompt_feats is not None))
        return move(src, dst, length)

    eng.proposer.move = spy
    prompts = _prompts(7, seed=41)
    budgets = [5, 40, 9, 40, 40, 40, 40]  # the short ones finish while the others queue context
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        eng.submit(Request(p, SamplingParams(max_new_tokens=n), f"r{i}", "math"))
    for _ in range(14):
        eng.step()
    assert any(pending > 0 for pending, _ in moves), f"no request with a backlog was moved: {moves}"
    got = _contexts(eng)
    assert len(got) >= 3
    for rid, (length, layers) in got.items():
        i = int(rid[1:])
        ref_len, ref_layers = _reference(target, drafter, prompts[i], length)
        n = min(length, ref_len)
        assert n > len(prompts[i]), (rid, n)
        for (k, v), (rk, rv) in zip(layers, ref_layers):
            assert torch.allclose(k[..., :n, :], rk[..., :n, :], atol=1e-5), rid
            assert torch.allclose(v[..., :n, :], rv[..., :n, :], atol=1e-5), rid
