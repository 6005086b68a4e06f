"""Where to branch and how long: recovery points from the chain's confidence, priced like verify lengths.

The first drafter's confidence c_k at block slot k (its top-token probability) is read as the
chance that proposal k survives verification. The chain then first fails at slot r with
probability f_r = c_1 ... c_{r-1} (1 - c_r): the recovery points are the top-K slots by f_r.

A branch at r offers an alternative a_r for slot r and l - 1 more tokens after it. Failing at r
commits the target's own token there anyway, so what the branch adds is the bonus after a_r and
the continuation's accepted tokens: with rho_r = q(a_r) / (1 - c_r) (the first drafter's chance
that a_r is the right token once the chain's is wrong) and beta the continuation's per-slot
survival (measured online),

    gain(r, l) = f_r * rho_r * (1 + beta + ... + beta^(l-1)).

It costs l verified tokens, plus (for l > 1) the recovery drafter's rows for one block and, once
per step when anyone branches past its first token, the recovery drafter's fixed cost. The
plan maximises committed tokens per second of the whole step, the rule the verify lengths
follow (sglang_adaflash.planner): Dinkelbach's method over a price lambda, each candidate
taking the l that maximises gain - lambda * cost (0 = no branch). At high concurrency lambda
rises toward 1 / per_token, and branches whose expected tokens per verified token fall below
the batch's own rate are dropped: the tree shrinks to the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeCost:
    """Seconds of one decode step, as the planner's PlanCost, plus the recovery drafter's part."""

    fixed: float  # the step's cost with the chains verified (drafting of the chain included)
    per_token: float
    per_branch: float = 0.0  # recovery-drafter rows for one branch block
    branch_fixed: float = 0.0  # the recovery drafter's forward, once per step


def first_fail(conf: torch.Tensor) -> torch.Tensor:
    """conf [n, S] confidences of slots 1..S -> [n, S] probability the chain first fails there."""
    reach = torch.cumprod(torch.cat([conf.new_ones(conf.shape[0], 1), conf[:, :-1]], 1), 1)
    return reach * (1 - conf)


def chain_tau(conf: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """E[committed tokens] of each chain verified to length L (slot 0 included)."""
    reach = torch.cumprod(conf, 1)  # [n, S]: slots 1..k all survive
    upto = torch.arange(conf.shape[1], device=conf.device)[None] < (lengths[:, None] - 1)
    return 1 + (reach * upto).sum(1)


@dataclass
class BranchPlan:
    slots: torch.Tensor  # [n, K] chain slot r of each candidate (1-based)
    lengths: torch.Tensor  # [n, K] branch length (0 = not taken)
    value: float  # expected committed tokens per second of the plan


def candidates(conf: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k recovery slots per row by first-fail probability, within each chain's length.

    Returns slots [n, k] (1-based) and their f [n, k] (0 where a row has fewer slots)."""
    f = first_fail(conf)
    s = conf.shape[1]
    inside = torch.arange(1, s + 1, device=conf.device)[None] < lengths[:, None]  # slot r < L
    f = f.masked_fill(~inside, 0.0)
    k = min(k, s)
    top, idx = f.topk(k, dim=1)
    return idx + 1, top


def plan_branches(
    conf: torch.Tensor,
    alt_prob: torch.Tensor,
    lengths: torch.Tensor,
    *,
    k: int,
    branch_len: int,
    beta: float,
    cost: TreeCost | None,
    rounds: int = 8,
) -> BranchPlan:
    """conf, alt_prob [n, S] (slots 1..S); lengths [n] chain verify lengths.

    cost None: the fixed rule, every candidate with f > 0 gets the longest branch that fits.
    """
    n = conf.shape[0]
    slots, f = candidates(conf, lengths, k)
    rho = (alt_prob.gather(1, slots - 1) / (1 - conf.gather(1, slots - 1)).clamp(min=1e-6)).clamp(0, 1)
    room = (lengths[:, None] - slots).clamp(min=0)  # slots r..L-1 keep the path within the block
    longest = room.clamp(max=branch_len)
    if cost is None:
        return BranchPlan(slots, torch.where(f > 0, longest, 0), float("nan"))
    ls = torch.arange(branch_len + 1, device=conf.device, dtype=torch.float32)  # candidate lengths 0..lmax
    cont = torch.cumsum(torch.cat([ls.new_zeros(1), beta ** ls[:-1]]), 0)  # 1 + beta + ... (l terms)
    gain = (f * rho)[..., None] * cont[None, None]  # [n, K, lmax+1]
    row_cost = cost.per_token * ls + cost.per_branch * (ls > 1).float()
    allowed = ls[None, None] <= longest[..., None]
    base_tokens = float(chain_tau(conf, lengths).sum())
    best = None
    for one_only in (False, True):
        ok = allowed & (ls[None, None] <= 1) if one_only else allowed
        lam, choice = base_tokens / cost.fixed, torch.zeros_like(slots)
        value = lam
        for _ in range(rounds):
            net = (gain - lam * row_cost).masked_fill(~ok, float("-inf"))
            choice = net.argmax(-1)
            tokens = base_tokens + float(gain.gather(2, choice[..., None]).sum())
            spent = cost.fixed + float(row_cost[choice].sum()) + cost.branch_fixed * bool((choice > 1).any())
            value = tokens / spent
            if value <= lam * (1 + 1e-7):
                break
            lam = value
        if best is None or value > best.value:
            best = BranchPlan(slots, choice, value)
    assert best is not None and n == best.slots.shape[0]
    return best
