"""Trimming a drafted block by the drafter's own confidence, slot by slot.

Why. The history plan (draft_choice) sets a drafted row's verify length before the drafter runs,
from the request's recent acceptance: a rate per request, the same for every step. Acceptance
is bursty, and a rate cannot tell the step whose first proposal is a guess from the one that
continues a run of boilerplate. The drafter can: on the embedded pair, in-domain, a reached
proposal whose drafter probability (the top of its softmax) is below 0.2 was accepted 33% of the
time, 0.4-0.6 85%, above 0.6 97% and more (a quarter of reached proposals sit below 0.2). So once
the block is drafted and its proposals read, the verify can end where the drafter stops being sure,
and the target is not paid for slots that will mostly be rejected. At in-domain c=8 the rule's
drafted rows verified 5.0 slots for 1.7 accepted proposals: most of a drafted step's verify was
waste.

How. :class:`ConfidenceCalibration` maps a proposal's drafter probability to the chance the
target accepts it once reached, learned online from every verified proposal in bins of that
probability (a drafter's probabilities are not calibrated: this one's are low by about half, and a
new version's differ). :func:`trim_lengths` then re-plans each drafted row's length within what
the history plan gave it, on the per-slot rates the calibration reads off its proposals, by the
same load-aware rule with the drafting cost sunk (planner.lengths.plan_on_host): keep a slot while
its expected tokens pay for its verify at the step's value.

Lossless at every temperature: a length that is a function of the drafter's distributions alone
(never of the tokens drawn from them) verifies a prefix of proposals drawn independently of the
decision, which speculative sampling accepts exactly. A DFlash block's distributions come from one
forward over masked slots, so no slot's distribution depends on another slot's draw.
"""

from __future__ import annotations

import numpy as np

from .lengths import PlanCost, _host_gains


class ConfidenceCalibration:
    """P(a reached proposal is accepted | its drafter probability p), in `bins` equal bins of p.

    Discounted counts per bin, from a prior that takes the drafter at its word (accepted at rate
    p, `prior_weight` pseudo-proposals a bin), multiplied by `decay` after every step's update.
    Host numpy: the engine reads it on a CPU, between the drafter and the verify.
    """

    def __init__(self, bins: int = 10, *, prior_weight: float = 4.0, decay: float = 0.995):
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.bins, self.prior_weight, self.decay = bins, float(prior_weight), float(decay)
        self.reset()

    def reset(self) -> None:
        """Back to the prior (a new drafter version: its probabilities mean something else)."""
        mid = (np.arange(self.bins, dtype=np.float64) + 0.5) / self.bins
        self.accepted = self.prior_weight * mid
        self.reached = np.full(self.bins, self.prior_weight)

    def _bin(self, p: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(p, dtype=np.float64) * self.bins).astype(np.int64), 0, self.bins - 1)

    def rate(self, p: np.ndarray) -> np.ndarray:
        """Acceptance rate of proposals with drafter probability p (any shape), float32."""
        return (self.accepted / self.reached)[self._bin(p)].astype(np.float32)

    def observe(self, p: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """One step's drafted rows: p [n, K] their proposals' drafter probabilities, verified [n]
        the proposals each verified (L - 1), accepted [n] how many of them the target accepted.
        Proposal j was reached when j <= accepted, and accepted when j < accepted."""
        p = np.asarray(p, dtype=np.float64)
        verified, accepted = np.asarray(verified), np.asarray(accepted)
        j = np.arange(p.shape[1])[None]
        reached = (j <= accepted[:, None]) & (j < verified[:, None])
        took = j < accepted[:, None]
        self.accepted *= self.decay
        self.reached *= self.decay
        bins = self._bin(p[reached])
        np.add.at(self.reached, bins, 1.0)
        np.add.at(self.accepted, bins, took[reached].astype(np.float64))


def trim_lengths(rates: np.ndarray, planned: np.ndarray, keep: np.ndarray, cost: PlanCost, block_size: int,
                 min_len: int, rounds: int = 8) -> np.ndarray:
    """Verify lengths [bs] no longer than `planned` [bs], from per-proposal acceptance rates.

    rates [bs, >= max(planned) - 1]: row i's proposal j is accepted with rates[i, j] once the
    ones before it were (read only below planned[i] - 1). keep [bs] bool: rows whose planned
    length stands (not drafted, or forced: a probe's verify is its evidence); they count in the
    step's value as they are. cost: the step's price with the drafting already paid (in fixed);
    per_draft and draft_fixed price what verifying more than the bonus token costs a row and the
    step (the verify's multi-token path; OnlineCostModel.trim_cost), so a drafted row may come
    down to its bonus token alone, or else verifies at least min(min_len, planned) slots.

    Maximises expected committed tokens per second of the step, as planner.lengths does, by
    Dinkelbach's rounds with the kept rows as constants in both sums, and the best plan that
    pays draft_fixed compared with every free row at its bonus token.
    """
    bs = planned.shape[0]
    planned = np.clip(planned.astype(np.int64), 1, block_size)
    survival = np.zeros((bs, block_size - 1), dtype=np.float32)
    width = min(rates.shape[1], block_size - 1)
    survival[:, :width] = rates[:, :width]
    gains = _host_gains(survival, block_size).astype(np.float64)  # [bs, B]: E[tau | L] at column L - 1
    lens = np.arange(1, block_size + 1)
    row_cost = cost.per_token * lens - cost.per_proposal + cost.per_draft * (lens > 1)  # [B]
    rows = np.arange(bs)
    free = rows[~keep]
    if free.size == 0:
        return planned
    tokens0 = float(gains[rows[keep], planned[keep] - 1].sum())
    spent0 = cost.fixed + float(row_cost[planned[keep] - 1].sum())
    multi_kept = bool((planned[keep] > 1).any())  # the step leaves the single-token path anyway
    base = spent0 + cost.draft_fixed  # a plan with a free row above its bonus token pays it
    lo = np.minimum(planned[free], max(min_len, 1))
    allowed = ((lens[None] >= lo[:, None]) & (lens[None] <= planned[free][:, None])) | (lens[None] == 1)
    g = gains[free]
    at = np.arange(free.size)

    def value(choice) -> float:
        spent = spent0 + float(row_cost[choice].sum()) + (cost.draft_fixed if multi_kept or choice.any() else 0.0)
        return (tokens0 + float(g[at, choice].sum())) / spent

    choice = planned[free] - 1
    lam = (tokens0 + float(g[at, choice].sum())) / (base + float(row_cost[choice].sum()))
    for _ in range(rounds):
        net = np.where(allowed, g - lam * row_cost[None], -np.inf)
        choice = net.argmax(1)
        v = (tokens0 + float(g[at, choice].sum())) / (base + float(row_cost[choice].sum()))
        if v <= lam * (1 + 1e-9):
            break
        lam = v
    if not multi_kept and cost.draft_fixed > 0:
        bonus_only = np.zeros_like(choice)
        if value(bonus_only) > value(choice):
            choice = bonus_only
    out = planned.copy()
    out[free] = choice + 1
    return out
