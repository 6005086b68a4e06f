"""Verify lengths that maximise expected committed tokens per second of a decode step.

Model. Request i's proposals survive verification one after another with probability a_i each
(a geometric acceptance process), so verifying L slots (slot 0, the last committed token, always
commits) yields E[tau_i | L] = sum_{s<L} a_i^s committed tokens. A step costs

    fixed + draft_fixed * [anyone drafts] + sum_i (per_token * L_i + per_draft * [L_i > 1])

seconds: `fixed` is what a plain decode step pays whatever the lengths, `per_token` the marginal
target compute per verified token, `per_draft` what drafting one more request costs (its rows of
the drafter forward) and `draft_fixed` what running the drafter at all costs (launches, weight
reads). L_i = 1 means the request is not drafted: it verifies only its bonus token.

Rule. Choose L_i in {1} u [min(min_len, cap_i), cap_i] maximising

    sum_i E[tau_i | L_i] / cost(L).

The per-request draft cost makes the value of a request's slots non-concave, so the old
"take slots in decreasing gain order" argument no longer applies. The ratio is instead solved by
Dinkelbach's method: for a price lambda (tokens per second) every request independently takes the
L maximising E[tau | L] - lambda * cost_i(L); lambda is then set to the plan's value, which never
decreases and stops at the optimum after a few rounds. `draft_fixed` is shared by the whole batch,
so the best plan that drafts (charged it) is compared with the plan that drafts nobody.

Everything stays on the tensors' device: on an accelerator the rounds run a fixed number of times
with no host synchronisation; on CPU (where a sync is free) they stop once lambda settles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

LENGTH_RULES = ("load_aware", "paper")


@dataclass(frozen=True)
class PlanCost:
    """Seconds of one decode step, split the way the rule needs (see the module docstring)."""

    fixed: float
    per_token: float
    per_draft: float = 0.0
    draft_fixed: float = 0.0

    def __post_init__(self):
        if self.fixed < 0 or self.per_token <= 0 or self.per_draft < 0 or self.draft_fixed < 0:
            raise ValueError(f"plan cost needs fixed, per_draft, draft_fixed >= 0 and per_token > 0, got {self}")


@functools.cache
def _tau_table(block_size: int, device: str, points: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """E[tau](a) = sum_{s<B} a^s on a grid of a in [0, 1): increasing, so it inverts by search."""
    a = torch.linspace(0.0, 1.0, points + 1, dtype=torch.float64)[:-1]
    tau = (a[:, None] ** torch.arange(block_size, dtype=torch.float64)).sum(-1)
    return a.float().to(device), tau.float().to(device)


def survival_rate(ratio: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-proposal survival a in [0, 1) whose E[tau] over a whole block is ratio * B.

    The length head predicts ratio = E[tau] / B for the whole block; the rule needs the survival
    behind it to price each slot. Stays on ratio's device.
    """
    grid, tau_grid = _tau_table(block_size, str(ratio.device))
    tau = (ratio.float() * block_size).clamp(1.0, block_size - 1e-3)
    hi = torch.searchsorted(tau_grid, tau).clamp(1, grid.numel() - 1)
    lo = hi - 1
    frac = (tau - tau_grid[lo]) / (tau_grid[hi] - tau_grid[lo])  # linear between grid points
    return grid[lo] + frac.clamp(0, 1) * (grid[hi] - grid[lo])


def expected_tau(survival: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """E[tau | L] = sum_{s<L} a^s per request (float)."""
    a = survival.float().clamp(0.0, 1.0)
    n = lengths.to(a.device).float()
    geometric = (1 - a.pow(n)) / (1 - a).clamp(min=1e-12)
    return torch.where(a >= 1 - 1e-6, n, geometric)


def _gains(survival: torch.Tensor, block_size: int) -> torch.Tensor:
    """[bs, B]: column L-1 holds E[tau | L]."""
    slots = torch.arange(block_size, device=survival.device, dtype=torch.float32)
    return (survival.float().clamp(0.0, 1.0)[:, None] ** slots[None]).cumsum(1)


def plan_lengths(
    survival: torch.Tensor,
    block_size: int,
    cost: PlanCost,
    *,
    min_len: int = 1,
    cap: torch.Tensor | None = None,
    allow_off: torch.Tensor | bool = True,
    rounds: int = 8,
) -> torch.Tensor:
    """survival [bs] -> verify lengths [bs] long on survival's device (see the module docstring).

    cap [bs]: the most slots a request may verify (e.g. the tokens it may still generate);
    allow_off: whether a request may verify only its bonus token (False: L >= min(min_len, cap)).
    """
    survival = survival.detach()
    bs, dev = survival.shape[0], survival.device
    if bs == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    lens = torch.arange(1, block_size + 1, device=dev)  # candidate L per column
    cap = (
        torch.full((bs,), block_size, dtype=torch.long, device=dev)
        if cap is None
        else cap.to(dev).long().clamp(1, block_size)
    )
    lo = cap.clamp(max=max(min_len, 1))
    off = torch.as_tensor(allow_off, device=dev).expand(bs) | (lo == 1)
    allowed = (lens[None] >= lo[:, None]) & (lens[None] <= cap[:, None])
    allowed |= (lens[None] == 1) & off[:, None]
    gains = _gains(survival, block_size)  # [bs, B]
    row_cost = cost.per_token * lens.float() + cost.per_draft * (lens > 1).float()  # [B]
    base = cost.fixed + cost.draft_fixed
    neg = torch.finfo(torch.float32).min
    lam = torch.zeros((), device=dev)
    choice = torch.zeros(bs, dtype=torch.long, device=dev)
    sync_free = dev.type == "cpu"
    for _ in range(rounds):
        net = (gains - lam * row_cost[None]).masked_fill(~allowed, neg)
        choice = net.argmax(1)
        value = gains.gather(1, choice[:, None]).sum() / (base + row_cost[choice].sum())
        if sync_free and float(value) <= float(lam) * (1 + 1e-7):
            break
        lam = value
    if cost.draft_fixed > 0:
        # the best plan charged draft_fixed, against drafting nobody (when everyone may be off)
        drafts = (choice > 0).any()
        tokens = gains.gather(1, choice[:, None]).sum()
        spent = cost.fixed + cost.draft_fixed * drafts.float() + row_cost[choice].sum()
        off_value = gains[:, 0].sum() / (cost.fixed + row_cost[0] * bs)
        better_off = off.all() & (off_value > tokens / spent)
        choice = torch.where(better_off, torch.zeros_like(choice), choice)
    return choice + 1


def paper_lengths(
    ratio: torch.Tensor, block_size: int, *, rate: float, min_len: int, cap: torch.Tensor | None = None
) -> torch.Tensor:
    """AdaFlash's published rule, clamp(round(ratio * B * rate), min_len, B), capped per request."""
    lens = torch.round(ratio.float() * block_size * rate).long().clamp(min=min_len, max=block_size)
    return lens if cap is None else torch.minimum(lens, cap.to(lens.device).long().clamp(min=1))


def plan_verify_lengths(
    ratio: torch.Tensor,
    block_size: int,
    *,
    rule: str = "load_aware",
    cost: PlanCost | None = None,
    rate: float = 1.3,
    min_len: int = 1,
    cap: torch.Tensor | None = None,
    survival: torch.Tensor | None = None,
    allow_off: torch.Tensor | bool = False,
) -> torch.Tensor:
    """The one dispatch both the engine and the SGLang plugin call: ratio [bs] -> lengths [bs].

    ``survival`` (e.g. calibrated by :class:`~.calibration.SurvivalPosterior`) replaces the
    survival read from the head's ratio for the load-aware rule.
    """
    if rule == "paper":
        return paper_lengths(ratio, block_size, rate=rate, min_len=min_len, cap=cap)
    if rule != "load_aware":
        raise ValueError(f"length rule must be one of {LENGTH_RULES}, found {rule!r}")
    if cost is None:
        raise ValueError("the load_aware rule needs a step cost model")
    a = survival if survival is not None else survival_rate(ratio, block_size)
    return plan_lengths(a, block_size, cost, min_len=min_len, cap=cap, allow_off=allow_off)
