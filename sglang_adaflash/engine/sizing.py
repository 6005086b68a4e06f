"""Sizing and pricing an engine: the bytes its caches take, and the step-cost profile the
load-aware rule starts from before it has measured any step of its own."""

from __future__ import annotations

from typing import Protocol

import torch

from ..core.clock import synced_time
from ..drafter.model import DFlashDrafter
from ..planner.cost import StepCostModel
from ..target.hf_target import HFTarget, TargetBatch
from .proposer import DFlashProposer


class ProfiledEngine(Protocol):
    """What profile_step_cost reads of an engine (SpecEngine): named here, so this module does
    not import the engine that imports it."""

    target: HFTarget
    drafter: DFlashDrafter | None
    proposer: object
    device: torch.device
    max_batch_size: int
    block_size: int


VERIFY_ROUNDS = 5  # rounds of the target's verify shapes, each shape timed once a round (best of)


def kv_cache_bytes(target: HFTarget, drafter: DFlashDrafter | None, *, mode: str, max_batch_size: int, max_seq_len: int) -> int:
    """What SpecEngine(...) with these settings allocates for its slot caches, up front.

    The caches are allocated whole at construction, so a caller can refuse settings that would
    not fit before torch tries (and the machine swaps or the process is killed).
    """
    capacity = max_seq_len + (drafter.config.block_size if drafter is not None else 1) + 1  # as __init__

    def cache(layers, kv_heads, head_dim, dtype) -> int:
        return 2 * layers * max_batch_size * kv_heads * capacity * head_dim * dtype.itemsize

    total = cache(target.num_layers, target.config.num_key_value_heads, target.head_dim, target.dtype)
    if mode != "ar" and drafter is not None:
        cfg = drafter.config
        total += cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, drafter.fc.weight.dtype)
    return total


def profile_step_cost(engine: ProfiledEngine, context: int = 64, repeats: int = 2) -> StepCostModel:
    """Fit time = fixed + per_token * T for one request's verify forward, and the drafter's costs.

    The target is timed at the shapes a verify has: one request over `context` cached tokens,
    verifying 1, 2 and a whole block's tokens (best of VERIFY_ROUNDS interleaved rounds). A
    verified token's price is the slope between 2 and a block (leaving the single-token path,
    the step from 1 to 2, is the online fit's own term), and `fixed` is what a plain step costs
    beyond its one token. Prefill-sized forwards (16 and 128 tokens from position 0) priced a
    verified token at half of what it costs where a verify runs: on the embedded pair, on an
    Intel Xeon, 0.087 ms against 0.19 between 2 and 9 verified tokens over 64-150 cached ones
    (benchmarks/adaptive/profile_shapes/). At one request the online fit hardly moves this
    price (its verify lengths vary too little to outweigh the ridge's centre), so the rule
    planned with a verified token at half its price.

    Runs on a scratch cache of its own; called once, lazily, by adaflash mode.
    """
    target = engine.target
    block = max(engine.block_size, 3)
    scratch = target.new_cache(1, context + block + 1)
    ids = torch.zeros(1, max(context, block), dtype=torch.long, device=engine.device)
    target.forward(TargetBatch(ids[:, :context], torch.zeros(1, dtype=torch.long, device=engine.device),
                               torch.tensor([context], device=engine.device)), scratch)  # the context (untimed)

    shapes = (1, 2, block)
    batches = [TargetBatch(ids[:, :q], torch.tensor([context], device=engine.device), torch.tensor([q], device=engine.device))
               for q in shapes]
    for batch in batches:
        target.forward(batch, scratch)  # untimed: a shape's first forward (allocations, caches) is no step's cost
    best = [float("inf")] * len(shapes)
    for _ in range(VERIFY_ROUNDS):  # interleaved: a burst of load spoils one round of each shape, not a slope
        for i, batch in enumerate(batches):
            t0 = synced_time(engine.device)
            target.forward(batch, scratch)
            best[i] = min(best[i], synced_time(engine.device) - t0)
    one, two, whole = best
    per_token = max((whole - two) / max(block - 2, 1), 1e-9)
    fixed = max(one - per_token, 0.0)
    per_draft = draft_fixed = per_proposal = 0.0
    if isinstance(engine.proposer, DFlashProposer):
        # drafting: a part paid once when anyone drafts and a part per drafted request (fitted
        # from two batch sizes); its LM head runs per proposal
        draft_times, wide = [], min(8, engine.max_batch_size)
        for n in (1, wide):
            zero = torch.zeros(n, dtype=torch.long, device=engine.device)
            best = float("inf")
            engine.proposer.propose(zero, zero, None, slots=list(range(n)))  # untimed, as above
            for _ in range(repeats):
                t0 = synced_time(engine.device)
                hidden = engine.proposer.propose(zero, zero, None, slots=list(range(n)))
                if engine.drafter.length_head is not None:
                    engine.drafter.length_head(hidden)
                best = min(best, synced_time(engine.device) - t0)
            draft_times.append(best)
        per_draft = max((draft_times[1] - draft_times[0]) / max(wide - 1, 1), 0.0)
        draft_fixed = max(draft_times[0] - per_draft, 0.0)
        head_times = []
        engine.proposer.proposal_logits(hidden[:1], torch.zeros(64, dtype=torch.long, device=engine.device),
                                        torch.ones(64, dtype=torch.long, device=engine.device))  # untimed
        for n in (4, 64):
            rows = torch.zeros(n, dtype=torch.long, device=engine.device)
            t0 = synced_time(engine.device)
            engine.proposer.proposal_logits(hidden[:1], rows, rows + 1)
            head_times.append(synced_time(engine.device) - t0)
        per_proposal = max((head_times[1] - head_times[0]) / 60, 0.0)  # the LM head, per proposal
        per_token += per_proposal
    return StepCostModel(fixed=fixed, per_token=per_token, per_draft=per_draft, draft_fixed=draft_fixed,
                         per_proposal=min(per_proposal, per_token * (1 - 1e-6)))
