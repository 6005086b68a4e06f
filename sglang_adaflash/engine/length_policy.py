"""AdaFlash's load-aware verify-length rule (ours; the paper uses a fixed rate and a fixed
concurrency threshold above which the head switches on).

Model. For request i the length head predicts ratio_i = E[tau_i] / B. We read it as a geometric
acceptance process: proposal k survives with probability a_i^k, where a_i solves
(1 - a^B) / (1 - a) = ratio_i * B. Verifying slot s (0-based; slot 0 always commits a token) then
adds a_i^s expected committed tokens. A step costs
    time(T) = fixed + per_token * T,       T = sum_i L_i verified tokens,
where `fixed` holds what does not depend on the lengths (the drafter forward, the target's weight
reads and launch overheads) and `per_token` the marginal target compute.

Rule. Maximise expected committed tokens per second of the step,
    (sum_i sum_{s < L_i} a_i^s) / (fixed + per_token * sum_i L_i),  L_i in [min_len, max_len_i].
Gains decrease along each request's slots, so taking extra slots in globally decreasing gain
order and keeping the best prefix is exact. At small batches `fixed` dominates and every request
verifies its whole block; as the batch grows, per-token compute dominates and doomed tail slots
are cut first, from the requests least likely to reach them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per decode step: fixed + per_token * verified tokens (fitted by profiling)."""

    fixed: float
    per_token: float

    def __post_init__(self):
        if self.fixed < 0 or self.per_token <= 0:
            raise ValueError(f"cost model needs fixed >= 0 and per_token > 0, got {self}")


class OnlineCostModel:
    """The step cost model, refitted from the engine's own step timings as it serves.

    A profile taken once at start-up cannot know the context lengths, batch mix and machine load
    the engine will meet, and the rule is only as good as its cost model. So every decode step
    reports (batch size, verified tokens, seconds), and an exponentially weighted ridge fit of
        seconds = a + b * batch_size + c * verified_tokens
    replaces the profile, which stays in the fit as the ridge's centre. The batch-size term keeps
    costs that grow with the batch but not with the verify lengths (drafting every block,
    attention over every context) out of the per-token price, which would otherwise make the
    rule cut too deep at high concurrency. For a batch of n requests the rule then sees
    fixed = a + b * n and per_token = c.
    """

    _SCALE = torch.tensor([1.0, 64.0, 1024.0], dtype=torch.float64)  # feature scales

    def __init__(self, prior: StepCostModel, *, decay: float = 0.97, prior_weight: float = 1e-3, warmup: int = 8):
        self.decay = decay
        self._centre = torch.tensor([prior.fixed, 0.0, prior.per_token], dtype=torch.float64) * self._SCALE
        self._ridge = prior_weight * torch.eye(3, dtype=torch.float64)
        self._xtx = torch.zeros(3, 3, dtype=torch.float64)
        self._xty = torch.zeros(3, dtype=torch.float64)
        self._theta = self._centre.clone()
        self._seen, self._warmup = 0, warmup

    def observe(self, batch_size: int, tokens: int, seconds: float) -> None:
        x = torch.tensor([1.0, batch_size, tokens], dtype=torch.float64) / self._SCALE
        self._xtx = self.decay * self._xtx + torch.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self._seen += 1
        if self._seen < self._warmup:  # a handful of steps cannot separate three terms yet
            return
        self._theta = torch.linalg.solve(self._xtx + self._ridge, self._xty + self._ridge @ self._centre)

    def model(self, batch_size: int) -> StepCostModel:
        a, b, c = (self._theta / self._SCALE).tolist()
        per_token = max(c, 1e-9)
        return StepCostModel(fixed=max(a + max(b, 0.0) * batch_size, 0.0), per_token=per_token)


@functools.cache
def _tau_table(block_size: int, points: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """E[tau](a) = sum_{s<B} a^s on a grid of a in [0, 1): increasing, so it inverts by search."""
    a = torch.linspace(0.0, 1.0, points + 1, dtype=torch.float64)[:-1]
    tau = (a[:, None] ** torch.arange(block_size, dtype=torch.float64)).sum(-1)
    return a.float(), tau.float()


def survival_rate(ratio: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-proposal survival a in [0, 1) whose truncated geometric mean tau matches ratio * B."""
    grid, tau_grid = _tau_table(block_size)
    tau = (ratio.float().cpu() * block_size).clamp(1.0, block_size - 1e-3)
    hi = torch.searchsorted(tau_grid, tau).clamp(1, grid.numel() - 1)
    lo = hi - 1
    frac = (tau - tau_grid[lo]) / (tau_grid[hi] - tau_grid[lo])  # linear between grid points
    return grid[lo] + frac.clamp(0, 1) * (grid[hi] - grid[lo])


def choose_verify_lengths(
    ratio: torch.Tensor,
    block_size: int,
    cost: StepCostModel,
    *,
    min_len: int = 1,
    max_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """ratio [bs] (length head) -> verify lengths [bs] long, each in [min_len, max_len_i]."""
    bs = ratio.shape[0]
    cap = torch.full((bs,), block_size, dtype=torch.long) if max_len is None else max_len.cpu().long().clamp(1, block_size)
    floor = torch.minimum(torch.full_like(cap, min_len), cap)
    a = survival_rate(ratio.cpu(), block_size)
    slots = torch.arange(block_size)
    gains = a[:, None] ** slots[None]  # [bs, B]: expected tokens from verifying slot s
    base = slots[None] < floor[:, None]
    optional = (slots[None] >= floor[:, None]) & (slots[None] < cap[:, None])
    base_gain = float(gains[base].sum())
    base_tokens = int(floor.sum())
    cand_gain = gains[optional]
    cand_req = torch.nonzero(optional)[:, 0]
    order = cand_gain.argsort(descending=True, stable=True)
    cum = torch.cat([torch.zeros(1), cand_gain[order].cumsum(0)])
    m = torch.arange(cum.numel(), dtype=torch.float32)
    value = (base_gain + cum) / (cost.fixed + cost.per_token * (base_tokens + m))
    take = int(value.argmax())
    extra = torch.bincount(cand_req[order[:take]], minlength=bs)
    return (floor + extra).to(ratio.device)
