"""The engine's side of AdaFlash's load-aware verify-length rule: its step cost model.

The rule itself (which lengths maximise expected committed tokens per second, drafting a request
or not) lives in :mod:`sglang_adaflash.planner`, shared with the SGLang plugin; this module
prices a step for it, from a start-up profile refitted online from the engine's own steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planner.lengths import PlanCost, plan_lengths, survival_rate

__all__ = ["OnlineCostModel", "StepCostModel", "choose_verify_lengths", "survival_rate"]


@dataclass(frozen=True)
class StepCostModel(PlanCost):
    """Seconds per decode step: fixed + per_token * verified tokens, plus what drafting costs:
    draft_fixed when anyone drafts and per_draft for every drafted request (0: drafting is free,
    which keeps every request drafted). The planner's `PlanCost`, under the engine's name."""

    def plan_cost(self) -> PlanCost:
        return PlanCost(self.fixed, self.per_token, self.per_draft, self.draft_fixed)


class OnlineCostModel:
    """The step cost model, refitted from the engine's own step timings as it serves.

    A profile taken once at start-up cannot know the context lengths, batch mix and machine load
    the engine will meet, and the rule is only as good as its cost model. So every decode step
    reports (batch size, verified tokens, drafted requests, seconds), and an exponentially
    weighted ridge fit of
        seconds = a + b * batch_size + c * verified_tokens + d * drafted + e * [drafted > 0]
    replaces the profile, which stays in the fit as the ridge's centre. The batch-size term keeps
    costs that grow with the batch but not with the verify lengths (attention over every context)
    out of the per-token price, which would otherwise make the rule cut too deep at high
    concurrency. d and e price drafting, which a request pays only when it is drafted: they are
    what the rule weighs against a request's expected accepted tokens when it decides whether to
    draft it at all. While every request is always drafted, b and d cannot be told apart and the
    ridge keeps d at the profile's value. For a batch of n requests the rule then sees
    fixed = a + b * n, per_token = c, per_draft = d and draft_fixed = e.
    """

    _SCALE = torch.tensor([1.0, 64.0, 1024.0, 64.0, 1.0], dtype=torch.float64)  # feature scales

    def __init__(self, prior: StepCostModel, *, decay: float = 0.97, prior_weight: float = 1e-3, warmup: int = 8):
        self.decay = decay
        centre = [prior.fixed, 0.0, prior.per_token, prior.per_draft, prior.draft_fixed]
        self._centre = torch.tensor(centre, dtype=torch.float64) * self._SCALE
        self._ridge = prior_weight * torch.eye(5, dtype=torch.float64)
        self._xtx = torch.zeros(5, 5, dtype=torch.float64)
        self._xty = torch.zeros(5, dtype=torch.float64)
        self._theta = self._centre.clone()
        self._seen, self._warmup, self._stale = 0, warmup, False

    def observe(self, batch_size: int, tokens: int, seconds: float, drafted: int | None = None) -> None:
        drafted = batch_size if drafted is None else drafted
        x = torch.tensor([1.0, batch_size, tokens, drafted, float(drafted > 0)], dtype=torch.float64) / self._SCALE
        self._xtx = self.decay * self._xtx + torch.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self._seen += 1
        self._stale = self._seen >= self._warmup  # a handful of steps cannot separate the terms

    def model(self, batch_size: int) -> StepCostModel:
        if self._stale:  # solved when asked, not after every step
            self._theta = torch.linalg.solve(self._xtx + self._ridge, self._xty + self._ridge @ self._centre)
            self._stale = False
        a, b, c, d, e = (self._theta / self._SCALE).tolist()
        # a negative drafting price is its collinear partner's share (while everyone drafts,
        # e moves with a and d with b): hand it back so the drafted steps keep their fitted time
        a, e = a + min(e, 0.0), max(e, 0.0)
        b, d = b + min(d, 0.0), max(d, 0.0)
        return StepCostModel(
            fixed=max(a + max(b, 0.0) * batch_size, 0.0),
            per_token=max(c, 1e-9),
            per_draft=max(d, 0.0),
            draft_fixed=max(e, 0.0),
        )


def choose_verify_lengths(
    ratio: torch.Tensor,
    block_size: int,
    cost: StepCostModel,
    *,
    min_len: int = 1,
    max_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """ratio [bs] (length head) -> verify lengths [bs] long, each in [min_len, max_len_i].

    Every request is drafted here (drafting costs nothing in this call), so this is the rule
    of a batch whose drafts are already paid for.
    """
    lens = plan_lengths(
        survival_rate(ratio, block_size),
        block_size,
        PlanCost(cost.fixed, cost.per_token),
        min_len=min_len,
        cap=max_len,
        allow_off=False,
    )
    return lens.to(ratio.device)
