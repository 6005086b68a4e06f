"""Where to branch and how long: recovery points from the chain's confidence, priced like verify lengths.

The first drafter's confidence c_k at block slot k (its top-token probability) is read as the
chance that proposal k survives verification. The chain then first fails at slot r with
probability f_r = c_1 ... c_{r-1} (1 - c_r): the recovery points are the top-K slots by f_r.

A branch at r offers an alternative a_r for slot r (the recovery drafter's, conditioned on the
chain's tokens before r) and l - 1 more tokens after it. Failing at r commits the target's own
token there anyway, so what the branch adds is the bonus after a_r and the continuation's
accepted tokens: with rho the chance that a_r is right once the chain's token is wrong and beta
the continuation's per-slot survival (both measured online by the engine),

    gain(r, l) = f_r * rho * (1 + beta + ... + beta^(l-1)).

It costs l verified tokens and the recovery drafter's rows for one block, plus, once per step
when anyone branches, the recovery drafter's fixed cost. A branch may carry up to W - 1 more
alternatives for slot r (the recovery drafter's next-ranked tokens from the same forward, one
node each, no continuation): the w-th is right, once the chain's token is wrong, with chance
rho_w (measured per rank), and only one alternative can be right, so alternative w adds
f_r * rho_w tokens for one verified token. The plan takes, per branch, the best number of them
(a prefix of the ranking). The chain's own slots are priced the same way (slot k is worth
c_1 ... c_k), so the load-aware rule may shorten the chain too. The
plan maximises expected committed tokens per second of the whole step, the rule the verify
lengths follow (sglang_adaflash.planner): Dinkelbach's method over a price lambda, each
candidate taking the l that maximises gain - lambda * cost (0 = no branch). At high concurrency
lambda rises toward 1 / per_token, and branches whose expected tokens per verified token fall
below the batch's own rate are dropped: the tree shrinks to the chain.

Two sources of branches can be priced against each other (`first_rates`, `--branch-drafter
auto`): the recovery drafter's, as above, and the first drafter's own next-ranked tokens at the
same slots, one node each (length 1, no drafter cost, their own measured rates per rank). The
plan is the better of the best tree of each; "no branch at all" is inside the second's choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TreeCost:
    """Seconds of one decode step, as the planner's PlanCost, plus the recovery drafter's part."""

    fixed: float  # the step's cost before any drafted row's verify slots (the chain's drafting included)
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
    chain: torch.Tensor | None = None  # [n] chain verify lengths (slot 0 included)
    extra: torch.Tensor | None = None  # [n, K] more alternatives at each branch's slot (0 = none)
    source: str = "recovery"  # who proposes the branches: "recovery" or "first" (see first_rates)


def candidates(conf: torch.Tensor, lengths: torch.Tensor, k: int, f: torch.Tensor | None = None):
    """Top-k recovery slots per row by first-fail probability, within each chain's length.

    Returns slots [n, k] (1-based) and their f [n, k] (0 where a row has fewer slots)."""
    f = first_fail(conf) if f is None else f
    s = conf.shape[1]
    inside = torch.arange(1, s + 1, device=conf.device)[None] < lengths[:, None]  # slot r < L
    f = f.masked_fill(~inside, 0.0)
    k = min(k, s)
    top, idx = f.topk(k, dim=1)
    return idx + 1, top


def plan_tree(
    conf: torch.Tensor,
    rho: torch.Tensor,
    cap: torch.Tensor,
    *,
    k: int,
    branch_len: int | np.ndarray,
    beta: float,
    cost: TreeCost | None,
    trim_chain: bool = False,
    rounds: int = 8,
    alts: tuple[float, ...] | list[float] | np.ndarray = (),
    start: float = 0.0,
    first_rates: tuple[float, ...] | list[float] | None = None,
    first_start: float = 0.0,
) -> BranchPlan:
    """conf, rho [n, S] (slots 1..S; rho may be a numpy array); cap [n] the most slots each row
    may verify; alts the chances rho_2, rho_3, ... that a branch's further alternatives are
    right (at most len(alts) of them per branch). branch_len and alts may also be given per
    slot ([S] and [S, W-1]): with `--branch-drafter joint` slot 1's branch is the recovery
    drafter's, with its rates and length, and the other slots' are the first drafter's one-node
    ranks. start: a first price to try (the previous step's plan value,
    which is usually close), so the iteration mostly ends after two rounds instead of three or
    four; from any start the prices rise to the same fixed point once a real plan's value is
    the price.

    first_rates (rho_1, rho_2, ...): the first drafter's next-ranked tokens as a second source
    of one-node branches, priced by verify tokens alone (first_start: that pass's first price);
    the returned plan's `source` says which source won. Without it, the recovery drafter's tree
    is weighed against no branch at all (its fixed cost is shared).

    The plan comes back on the host (the engine reads it as lists to build the trees): the
    load-aware plan is solved there, and the fixed one is read back in one copy.

    cost None: the fixed rule, chains of length cap and every candidate with f > 0 branching
    as long as fits, with every alternative. Otherwise the plan maximising expected tokens per
    second; trim_chain lets it shorten the chains too, slot k kept while its survival
    c_1 ... c_k pays its verify slot at the plan's price (a chain keeps at least one proposal).
    """
    cap = cap.long()
    n_slots = conf.shape[1]
    lens_s = np.broadcast_to(np.asarray(branch_len, dtype=np.int64), (n_slots,))  # longest branch per slot
    alts_s = np.asarray(alts, dtype=np.float64)
    if alts_s.ndim == 1:
        alts_s = np.broadcast_to(alts_s, (n_slots, alts_s.shape[0]))  # [S, W-1]: the same rates at every slot
    if cost is None:
        slots, f = candidates(conf, cap.to(conf.device), k)
        per_slot = torch.as_tensor(np.array(lens_s), device=conf.device)[slots - 1]
        longest = torch.where(f > 0, torch.minimum((cap.to(conf.device)[:, None] - slots).clamp(min=0), per_slot), 0)
        slots, longest = torch.cat([slots, longest], 1).cpu().split([slots.shape[1]] * 2, dim=1)  # one read
        return BranchPlan(slots, longest, float("nan"), cap.cpu(), torch.where(longest > 0, alts_s.shape[1], 0))
    # a few dozen numbers per row: numpy on the host is several times faster than torch here,
    # and for one or two rows plain Python is faster again (see _RowPlanner)
    c = conf.detach().double().cpu().numpy()
    capn = cap.cpu().numpy()
    n, s = c.shape
    reach = np.cumprod(c, 1)
    f_all = np.concatenate([np.ones((n, 1)), reach[:, :-1]], 1) * (1 - c)
    tau_at = np.concatenate([np.ones((n, 1)), 1 + reach.cumsum(1)], 1)  # [n, S+1]: E[tau | L] at L-1
    in_cap = np.arange(1, s + 1)[None] < capn[:, None]
    kk = min(k, s)
    rows = np.arange(n)[:, None]
    small = _RowPlanner(reach, f_all, tau_at, capn, kk, cost, trim_chain) if n <= SMALL_PLAN_ROWS else None

    def source(r_all, lens, per_branch, branch_fixed, rates):
        """lens [S] the longest branch per slot, rates [S, W-1] the further alternatives' rates."""
        ls = np.arange(int(lens.max()) + 1, dtype=np.float64)  # branch lengths 0..lmax
        cont = np.concatenate([[0.0], np.cumsum(beta ** ls[:-1])])  # 1 + beta + ... (l terms)
        return (r_all, lens, ls, cont, cost.per_token * ls + per_branch * (ls > 0), branch_fixed, rates)

    def plan_at(lam: float, src, branching: bool):
        if small is not None:
            return small.plan_at(lam, src, branching)
        r_all, lens, ls, cont, row_cost, branch_fixed, rho_alt = src
        chain = capn
        if trim_chain:
            keep = np.cumprod((reach > lam * cost.per_token) & in_cap, 1).sum(1)
            chain = np.minimum(1 + np.maximum(keep, 1), capn)
        f = np.where(np.arange(1, s + 1)[None] < chain[:, None], f_all, 0.0)
        idx = np.argsort(-f, 1, kind="stable")[:, :kk]
        fk = f[rows, idx]
        slots = idx + 1
        longest = (np.where(fk > 0, np.minimum(np.clip(capn[:, None] - slots, 0, None), lens[idx]), 0) if branching
                   else np.zeros_like(slots))
        gain = (fk * r_all[rows, idx])[..., None] * cont[None, None]  # [n, K, lmax+1]
        # the best prefix of the further alternatives, worth having only beside a branch (l >= 1)
        alt_gain = fk[..., None] * rho_alt[idx]  # [n, K, W-1]
        alt_net = np.concatenate([np.zeros((n, kk, 1)), np.cumsum(alt_gain - lam * cost.per_token, 2)], 2)
        extra = alt_net.argmax(-1)  # [n, K]
        alt_tokens = np.concatenate([np.zeros((n, kk, 1)), np.cumsum(alt_gain, 2)], 2)
        with_alts = np.where(ls[None, None] > 0, alt_net.max(-1)[..., None], 0.0)
        net = np.where(ls[None, None] > longest[..., None], -np.inf, gain - lam * row_cost + with_alts)
        choice = net.argmax(-1)
        extra = np.where(choice > 0, extra, 0)
        tokens = (tau_at[np.arange(n), chain - 1].sum() + np.take_along_axis(gain, choice[..., None], 2).sum()
                  + np.take_along_axis(alt_tokens, extra[..., None], 2).sum())
        spent = (cost.fixed + cost.per_token * (chain.sum() + extra.sum()) + row_cost[choice].sum()
                 + branch_fixed * bool((choice > 0).any()))
        return slots, choice, float(tokens / spent), chain, extra

    def best_of(src, branching: bool, first_price: float):
        best, lam = None, max(first_price, 0.0)
        for i in range(rounds):
            plan = plan_at(lam, src, branching)
            if best is None or plan[2] > best[2]:
                best = plan
            # a price that is a real plan's value cannot be beaten by less; a guessed one can
            if plan[2] <= lam * (1 + 1e-7) and (i > 0 or first_price <= 0):
                break
            lam = plan[2]
        return best

    rho_n = rho if isinstance(rho, np.ndarray) else rho.detach().double().cpu().numpy()
    recovery = source(rho_n, lens_s, cost.per_branch, cost.branch_fixed, alts_s)
    best, won = best_of(recovery, True, start), "recovery"
    if first_rates is not None and len(first_rates) > 0:
        rates = np.asarray(list(first_rates), dtype=np.float64)
        first = source(np.full((n, s), rates[0]), np.ones(s, dtype=np.int64), 0.0, 0.0,
                       np.broadcast_to(rates[1:], (s, rates.shape[0] - 1)))
        other = best_of(first, True, first_start)
        if other[2] > best[2]:
            best, won = other, "first"
    elif cost.branch_fixed > 0 and any(x > 0 for row in best[1] for x in row):
        # branch_fixed is shared: the best tree against no branch at all (skipped where nothing
        # is shared to save, or no branch was taken: the first pass's optimum is the answer)
        other = best_of(recovery, False, start)
        if other[2] > best[2]:
            best = other
    slots, choice, value, chain, extra = best

    def t(x):
        return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.long)

    return BranchPlan(t(slots), t(choice), value, t(chain), t(extra), won)


# plan_tree's rows at most this many: each price's plan is made row by row in plain Python
# (_RowPlanner), the same arithmetic in the same order as the numpy path, so the same plan.
# At c=1 on the embedded pair (one CPU thread) the numpy path took 0.46 ms of a 10.7 ms step,
# run between the forwards that evict its code and data from the core's caches, and the rows
# take 0.23 (benchmarks/d2sd/step_parts_lean*.json).
SMALL_PLAN_ROWS = 2


class _RowPlanner:
    """plan_tree's plan at one price, for few rows, in Python lists instead of numpy arrays."""

    def __init__(self, reach, f_all, tau_at, capn, kk, cost: TreeCost, trim_chain: bool):
        self.reach, self.f_all, self.tau_at = reach.tolist(), f_all.tolist(), tau_at.tolist()
        self.cap, self.kk, self.cost, self.trim = capn.tolist(), kk, cost, trim_chain
        self._lists: dict[int, tuple] = {}

    def _source(self, src) -> tuple:
        key = id(src)  # a source is made once per plan and asked at several prices
        if key not in self._lists:
            r_all, lens, _, cont, row_cost, branch_fixed, rho_alt = src
            self._lists[key] = (src, np.asarray(r_all).tolist(), np.asarray(lens).tolist(), cont.tolist(),
                                row_cost.tolist(), branch_fixed, np.asarray(rho_alt).tolist())
        return self._lists[key][1:]

    def plan_at(self, lam: float, src, branching: bool):
        r_all, lens, cont, row_cost, branch_fixed, rho_alt = self._source(src)
        per_token = self.cost.per_token
        thr = lam * per_token
        n_len = len(cont)
        s = len(self.reach[0])
        slots_out, choice_out, chain_out, extra_out = [], [], [], []
        tau_sum = gain_sum = alt_sum = rows_cost = 0.0
        chain_total = extra_total = 0
        for i, cap in enumerate(self.cap):
            chain = cap
            if self.trim:
                keep = 0
                for j, r in enumerate(self.reach[i]):
                    if not (r > thr and j + 1 < cap):
                        break
                    keep += 1
                chain = min(1 + max(keep, 1), cap)
            f = [x if j + 1 < chain else 0.0 for j, x in enumerate(self.f_all[i])]
            idx = sorted(range(s), key=lambda j: -f[j])[: self.kk]  # stable, as np.argsort(kind="stable")
            slots, choices, extras = [], [], []
            for j in idx:
                fk, slot = f[j], j + 1
                longest = min(max(cap - slot, 0), lens[j]) if branching and fk > 0 else 0
                base = fk * r_all[i][j]
                run_net = best_net = run_tok = 0.0
                extra, alt_tok = 0, [0.0]
                for w, rate in enumerate(rho_alt[j]):  # the best prefix of the further alternatives
                    g = fk * rate
                    run_net += g - thr
                    run_tok += g
                    alt_tok.append(run_tok)
                    if run_net > best_net:
                        best_net, extra = run_net, w + 1
                choice, best = 0, -math.inf
                for ln in range(n_len):
                    net = -math.inf if ln > longest else base * cont[ln] - lam * row_cost[ln] + (best_net if ln else 0.0)
                    if net > best:
                        choice, best = ln, net
                extra = extra if choice > 0 else 0
                gain_sum += base * cont[choice]
                alt_sum += alt_tok[extra]
                rows_cost += row_cost[choice]
                extra_total += extra
                slots.append(slot)
                choices.append(choice)
                extras.append(extra)
            tau_sum += self.tau_at[i][chain - 1]
            chain_total += chain
            slots_out.append(slots)
            choice_out.append(choices)
            chain_out.append(chain)
            extra_out.append(extras)
        tokens = tau_sum + gain_sum + alt_sum
        spent = (self.cost.fixed + per_token * (chain_total + extra_total) + rows_cost
                 + branch_fixed * any(x > 0 for row in choice_out for x in row))
        return slots_out, choice_out, float(tokens / spent), chain_out, extra_out


def plan_branches(conf, rho, lengths, *, k, branch_len, beta, cost, rounds: int = 8, alts=(), start=0.0,
                  first_rates=None) -> BranchPlan:
    """The plan for chains of fixed lengths (the verify lengths are given)."""
    return plan_tree(conf, rho, lengths, k=k, branch_len=branch_len, beta=beta, cost=cost, rounds=rounds, alts=alts,
                     start=start, first_rates=first_rates)
