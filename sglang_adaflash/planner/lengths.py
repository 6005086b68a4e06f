"""Verify lengths that maximise expected committed tokens per second of a decode step.

Model. Request i's proposals survive verification one after another with probability a_i each
(a geometric acceptance process), so verifying L slots (slot 0, the last committed token, always
commits) yields E[tau_i | L] = sum_{s<L} a_i^s committed tokens. A step costs

    fixed + draft_fixed * [anyone drafts]
          + sum_i (per_token * L_i - per_proposal + per_draft * [L_i > 1])

seconds: `fixed` is what a plain decode step pays whatever the lengths, `per_token` the marginal
price of a verified proposal (target compute, and the drafter's LM head that made it),
`per_proposal` the part of it a row's bonus token does not pay (it has no proposal: a plain step
costs fixed + (per_token - per_proposal) * n), `per_draft` what drafting one more request costs
(its rows of the drafter forward) and `draft_fixed` what running the drafter at all costs
(launches, weight reads). L_i = 1 means the request is not drafted: it verifies only its bonus
token.

Rule. Choose L_i in {1} u [min(min_len, cap_i), cap_i] maximising

    sum_i E[tau_i | L_i] / cost(L).

The per-request draft cost makes the value of a request's slots non-concave, so the old
"take slots in decreasing gain order" argument no longer applies. The ratio is instead solved by
Dinkelbach's method: for a price lambda (tokens per second) every request independently takes the
L maximising E[tau | L] - lambda * cost_i(L); lambda is then set to the plan's value, which never
decreases and stops at the optimum after a few rounds. `draft_fixed` is shared by the whole batch,
so the best plan that drafts (charged it) is compared with the plan that drafts nobody.

On an accelerator everything stays on the tensors' device and the rounds run a fixed number of
times with no host synchronisation; on a CPU (where a read is free) they run in numpy, whose calls
cost a tenth of torch's on tensors this small, and stop once lambda settles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

LENGTH_RULES = ("load_aware", "paper")


@dataclass(frozen=True)
class PlanCost:
    """Seconds of one decode step, split the way the rule needs (see the module docstring)."""

    fixed: float
    per_token: float
    per_draft: float = 0.0
    draft_fixed: float = 0.0
    per_proposal: float = 0.0

    def __post_init__(self):
        if self.fixed < 0 or self.per_token <= 0 or self.per_draft < 0 or self.draft_fixed < 0:
            raise ValueError(f"plan cost needs fixed, per_draft, draft_fixed >= 0 and per_token > 0, got {self}")
        if not 0 <= self.per_proposal < self.per_token:
            raise ValueError(f"plan cost needs 0 <= per_proposal < per_token, got {self}")

    def plain_step(self, batch_size: int) -> float:
        """Seconds of a step that drafts nobody: every row verifies its bonus token alone."""
        return self.fixed + (self.per_token - self.per_proposal) * batch_size


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
    """[bs, B]: column L-1 holds E[tau | L].

    survival [bs]: one rate for every proposal (the geometric process); or [bs, B-1]: proposal
    j's own chance to be accepted once those before it were (see :func:`plan_lengths`)."""
    a = survival.float().clamp(0.0, 1.0)
    if a.dim() == 2:
        reach = torch.cumprod(a[:, : block_size - 1], dim=1)
        return torch.cat([torch.ones_like(a[:, :1]), reach], dim=1).cumsum(1)
    slots = torch.arange(block_size, device=survival.device, dtype=torch.float32)
    return (a[:, None] ** slots[None]).cumsum(1)


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

    survival may also be [bs, B-1], a rate per proposal along the block (proposal j survives
    with survival[i, j] once the ones before it did): a drafter's later proposals are accepted
    less often than its first, and one rate per request prices the chain's tail above its worth.

    cap [bs]: the most slots a request may verify (e.g. the tokens it may still generate);
    allow_off: whether a request may verify only its bonus token (False: L >= min(min_len, cap)).
    """
    survival = survival.detach()
    bs, dev = survival.shape[0], survival.device
    if bs == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    if dev.type == "cpu":
        cap_np = None if cap is None else cap.detach().cpu().numpy()
        off_np = np.broadcast_to(np.asarray(allow_off.detach().cpu().numpy() if isinstance(allow_off, torch.Tensor)
                                            else allow_off, dtype=bool), (bs,))
        return torch.from_numpy(plan_on_host(survival.numpy(), block_size, cost, min_len, cap_np, off_np, rounds))
    return _plan_in_torch(survival, block_size, cost, min_len, cap, allow_off, rounds)


def _plan_in_torch(survival, block_size: int, cost: PlanCost, min_len: int, cap, allow_off, rounds: int) -> torch.Tensor:
    """Dinkelbach's rounds in torch, a fixed number of them: nothing is read back to the host
    (what an accelerator runs; on a CPU :func:`plan_on_host` gives the same plan)."""
    bs, dev = survival.shape[0], survival.device
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
    row_cost = cost.per_token * lens.float() - cost.per_proposal + cost.per_draft * (lens > 1).float()  # [B]
    base = cost.fixed + cost.draft_fixed
    neg = torch.finfo(torch.float32).min
    lam = torch.zeros((), device=dev)
    choice = torch.zeros(bs, dtype=torch.long, device=dev)
    for _ in range(rounds):
        net = (gains - lam * row_cost[None]).masked_fill(~allowed, neg)
        choice = net.argmax(1)
        lam = gains.gather(1, choice[:, None]).sum() / (base + row_cost[choice].sum())
    if cost.draft_fixed > 0:
        # the best plan charged draft_fixed, against drafting nobody (when everyone may be off)
        drafts = (choice > 0).any()
        tokens = gains.gather(1, choice[:, None]).sum()
        spent = cost.fixed + cost.draft_fixed * drafts.float() + row_cost[choice].sum()
        off_value = gains[:, 0].sum() / (cost.fixed + row_cost[0] * bs)
        better_off = off.all() & (off_value > tokens / spent)
        choice = torch.where(better_off, torch.zeros_like(choice), choice)
    return choice + 1


def plan_on_host(survival: np.ndarray, block_size: int, cost: PlanCost, min_len: int, cap: np.ndarray | None,
                 allow_off: np.ndarray, rounds: int = 8) -> np.ndarray:
    """The same plan in numpy, its rounds stopping once the value settles. On a CPU, where
    reading a tensor costs nothing, torch's per-call overhead is the plan's whole cost on arrays
    this small: about 0.5 ms a step in torch against a tenth of it here (the engine plans every
    step, and at c=1 a step takes about 17 ms)."""
    bs = survival.shape[0]
    lens = np.arange(1, block_size + 1)
    cap = np.full(bs, block_size, dtype=np.int64) if cap is None else np.clip(cap.astype(np.int64), 1, block_size)
    lo = np.minimum(cap, max(min_len, 1))
    off = allow_off | (lo == 1)
    allowed = (lens[None] >= lo[:, None]) & (lens[None] <= cap[:, None])
    allowed[:, 0] |= off
    gains = _host_gains(survival, block_size)
    row_cost = (cost.per_token * lens - cost.per_proposal + cost.per_draft * (lens > 1)).astype(np.float32)
    if bs == 1:
        # one request: every allowed length's own ratio (drafting nobody pays no draft_fixed)
        spent = cost.fixed + cost.draft_fixed * (lens > 1) + row_cost.astype(np.float64)
        return np.array([int(np.where(allowed[0], gains[0] / spent, -np.inf).argmax()) + 1])
    base = cost.fixed + cost.draft_fixed
    if cost.draft_fixed > 0 and off.all():
        # Drafting nobody, checked first: at the plain step's own value lam_p = bs / plain cost,
        # if every row's best length is 1 then any plan that drafts has
        # sum(gain - lam_p * cost_i) <= lam_p * fixed < lam_p * (fixed + draft_fixed), so its
        # value is below lam_p and the rounds below would end in "nobody" too. That is most
        # plans of a batch drafting does not pay for, and this costs one round, not several.
        lam_p = bs / (cost.fixed + float(row_cost[0]) * bs)
        net = gains - np.float32(lam_p) * row_cost[None]
        net[~allowed] = -np.inf
        if not net.argmax(1).any():
            return np.ones(bs, dtype=np.int64)
    rows = np.arange(bs)
    lam = 0.0
    choice = np.zeros(bs, dtype=np.int64)
    for _ in range(rounds):
        net = gains - np.float32(lam) * row_cost[None]
        net[~allowed] = -np.inf
        choice = net.argmax(1)
        value = float(gains[rows, choice].sum(dtype=np.float64)) / (base + float(row_cost[choice].sum(dtype=np.float64)))
        if value <= lam * (1 + 1e-7):
            break
        lam = value
    if cost.draft_fixed > 0 and off.all():
        # the best plan charged draft_fixed, against drafting nobody
        tokens = float(gains[rows, choice].sum(dtype=np.float64))
        spent = cost.fixed + cost.draft_fixed * float(choice.any()) + float(row_cost[choice].sum(dtype=np.float64))
        off_value = float(gains[:, 0].sum(dtype=np.float64)) / (cost.fixed + float(row_cost[0]) * bs)
        if off_value > tokens / spent:
            choice = np.zeros_like(choice)
    return choice + 1


def _host_gains(survival: np.ndarray, block_size: int) -> np.ndarray:
    """:func:`_gains` in numpy (float32)."""
    a = np.clip(survival.astype(np.float32), 0.0, 1.0)
    if a.ndim == 2:
        reach = np.cumprod(a[:, : block_size - 1], axis=1, dtype=np.float32)
        return np.cumsum(np.concatenate([np.ones_like(a[:, :1]), reach], axis=1), axis=1, dtype=np.float32)
    return np.cumsum(a[:, None] ** np.arange(block_size, dtype=np.float32)[None], axis=1, dtype=np.float32)


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
