"""The engine's per-step and per-request state: its counters, a step's SpecBatch, a running request.

Apart from the engine so that its helpers (admission's probe, D2SD's engine, the benchmarks)
build and read them without importing the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.spec_metadata import SpecMetadata
from .request import Request, RequestStats


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    verified_tokens: int = 0
    committed_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    trimmed_slots: int = 0  # planned verify slots the confidence trim left out (see _trim)


@dataclass
class SpecBatch(SpecMetadata):
    """The step's contract (core.spec_metadata: lengths, proposals, q, which rows sample) and
    what the engine's own bookkeeping needs besides: whom it drafted, and what it predicted.

    Rows are the running requests (row i sits in cache slot i). A row that was not drafted
    verifies only its bonus token (length 1) and has no proposals.
    """

    drafted: list[int] = field(default_factory=list)  # rows the drafter ran for
    probes: list[int] = field(default_factory=list)  # drafted rows that were forced to
    head_ratio: torch.Tensor | None = None  # [len(drafted)] the length head's E[tau]/B
    head_survival: torch.Tensor | None = None  # [len(drafted)] survival read from it
    survival: torch.Tensor | None = None  # [len(drafted)] calibrated survival
    draft_seconds: float = 0.0  # what the drafter forward, the head and the proposals took
    forced_catch_up_seconds: float = 0.0  # the catch-up of forced rows riding along (timed apart)
    catch_up_seconds: float = 0.0  # the drafted rows' backlog catch-up (part of draft_seconds; see _catch_up)
    confidence: np.ndarray | None = None  # [bs, K] drafter probability of each proposal read (see _trim)
    read_proposals: int | None = None  # proposals the drafter's LM head computed, when not those verified (_trim)

    def predicted_ratios(self, block_size: int, adaptive: bool) -> list[float] | None:
        """E[tau | L] / B per row as planned (1/B for a row not drafted: its tau is 1)."""
        if not adaptive:
            return None
        out = [1.0 / block_size] * len(self.lengths)
        if not self.drafted:
            return out
        # plain Python on a few floats per row: this runs every step, for the stats alone
        if self.survival is not None:
            lengths = self.lengths.tolist()
            for i, a in zip(self.drafted, self.survival.float().tolist()):
                out[i] = _expected_tau(a, lengths[i]) / block_size
        elif self.head_ratio is not None:
            for i, r in zip(self.drafted, self.head_ratio.float().tolist()):
                out[i] = r
        return out


def _expected_tau(a: float, n: int) -> float:
    """planner.lengths.expected_tau of one row, in Python floats."""
    a = min(max(a, 0.0), 1.0)
    return float(n) if a >= 1 - 1e-6 else (1 - a**n) / max(1 - a, 1e-12)


@dataclass
class _Seq:
    req: Request
    index: int
    stats: RequestStats
    output: list[int] = field(default_factory=list)
    cache_len: int = 0  # tokens whose K/V (and drafter context, less `pending`) are committed
    finish: str | None = None
    pending: int = 0  # committed tokens not yet in the drafter's context (see _catch_up)
    since_draft: int = 0  # decode steps since this request was last drafted
    probe_gap: int = 0  # steps between probes while not drafted (backs off while probes fail)
    generator: torch.Generator | None = None  # a seeded sampled request's own random stream
    prompt_feats: torch.Tensor | None = None  # [P, K*H] prompt features not yet in the drafter's context
    stale_context: bool = False  # its drafter context was computed by a version no longer serving

    @property
    def last_token(self) -> int:
        return self.output[-1]

    @property
    def remaining(self) -> int:
        return self.req.sampling.max_new_tokens - len(self.output)
