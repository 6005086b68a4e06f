"""Draft-off: which rows of a step the drafter runs for, and the probe credit that pays for the rest.

A row whose expected accepted tokens do not pay for its share of the drafter forward and its
verify slots is left out and verifies only its bonus token. Its history is then the only
estimate of what drafting would give, so once `probe_every` steps have passed it is drafted
anyway (a probe), which notices a request that starts accepting again. Probes are paid from a
credit that grows by `probe_share` of a plain step's cost every step, so probing never costs
more than that share of the time. Rows with no history at all read the drafter once (a first
read), at most a few per domain and step.

The engine asks :meth:`DraftChoice.choose` at the start of every step, and after the step
reports what forced drafting really cost (:meth:`DraftChoice.charge_forced`) and, per probe,
whether it accepted anything (:meth:`DraftChoice.next_probe_gap`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ..planner.calibration import SurvivalPosterior
from ..planner.cost import StepCostModel
from ..planner.lengths import plan_lengths, plan_on_host


class DraftedStep(Protocol):
    """What charge_forced reads of a step (the engine's SpecBatch): named here, so this module
    does not import the engine that imports it."""

    drafted: list[int]
    draft_seconds: float
    forced_catch_up_seconds: float

MAX_PROBE_GAP = 4  # an undrafted request is probed at least every 4 * probe_every steps
FIRST_READS = 4  # cold requests of one domain that read the drafter in one step (see first_reads)
QUIET_REPLAN = 32  # steps a "draft nobody" plan stands while nobody drafts or joins
QUIET_FADING = 8  # ... while undrafted requests' evidence fades towards their domain's (SurvivalPosterior.idle)
PLAIN_EVERY = 64  # steps in a row that drafted anyone, after which one step runs plain (a plain probe)
PLAIN_FIRST = 8  # ... at a batch size with no plain step seen yet; the wait doubles with each seen
LONG_SHOT_SHARE = 0.25  # of the probe credit, where not even rows as good as the best evidence pay (could_pay)


class DraftChoice:
    def __init__(self, posterior: SurvivalPosterior, block_size: int, min_len: int, device, *,
                 probe_every: int = 16, probe_share: float = 0.02, explore: bool = False, seed: int = 0):
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        if not 0 <= probe_share <= 1:
            raise ValueError(f"probe_share must be in [0, 1], got {probe_share}")
        self.posterior, self.block_size, self.min_len, self.device = posterior, block_size, min_len, device
        self.probe_every, self.probe_share, self.explore = probe_every, probe_share, explore
        self.explore_gen = torch.Generator(device=device).manual_seed(seed + 1)  # apart from sampling's
        self.host = torch.device(device).type == "cpu"  # plan in numpy (_plan_on_host)
        self.credit = 0.0  # seconds of drafting probes may still spend
        # (paid, per_token, debt bound, plain step price) of a step that drafted only forced rows
        self.forced_charge: tuple[float, float, float, float] | None = None
        self._quiet_plan: int | None = None  # batch size of the last "draft nobody" plan
        self._quiet_steps = 0
        self._since_plain = 0  # steps in a row that drafted anyone (see PLAIN_EVERY)
        self._plain_seen: dict[int, int] = {}  # plain steps chosen per batch size (see plain_wait)
        self._could_pay_memo: list | None = None  # [key, answer, steps since, posterior] (_could_pay)
        # the last choice's plan, for an engine that drafts by it (lengths_from="history"):
        self.lengths: torch.Tensor | None = None  # [bs] long on the host: planned verify lengths
        self.rate: torch.Tensor | None = None  # [bs] the posterior survival the plan read

    def replan(self) -> None:
        """Plan afresh at the next step: a standing "draft nobody" plan is void (the evidence it
        stood on was dropped, or the drafter changed)."""
        self._quiet_plan, self._quiet_steps = None, 0
        self._could_pay_memo = None

    @property
    def max_pending(self) -> int:
        """Steps an undrafted row can go without drafting, plus one: its context backlog's size."""
        return MAX_PROBE_GAP * self.probe_every + 1

    def choose(self, seqs, caps: list[int], cost: StepCostModel, *, measured: bool) -> tuple[list[int], list[int]]:
        """Rows to draft this step, and which of them are forced (first reads, probes).

        Due probes wait until the credit covers them and then share one drafter forward (or ride
        along, at their own rows' cost, on a step that drafts anyway). `measured`: the cost model
        is the engine's measured one, so a step of forced rows alone is charged what it took.
        """
        self.forced_charge = None
        # This runs on every step, and on most steps of a batch that does not pay for drafting it
        # decides "nobody": that path stays in plain Python (no tensor is built before the plan).
        bs = len(seqs)
        row = cost.per_draft + cost.per_token * max(self.min_len - 1, 1)  # one probe row's price
        pays = self._could_pay(bs, cost)
        share = self.probe_share if pays else self.probe_share * LONG_SHOT_SHARE
        self.credit = min(self.credit + share * cost.plain_step(bs), cost.draft_fixed + row * bs)
        gap = self.probe_every

        def due_rows() -> list[int]:
            return [i for i, s in enumerate(seqs) if caps[i] > 1 and s.since_draft >= max(s.probe_gap, gap)]

        due = due_rows() if self.credit >= cost.draft_fixed + row else None
        # Nothing a plan reads changes over a step where nobody drafted and nobody joined, except
        # the cost model's slow drift and the fading of undrafted requests' own evidence: the
        # plan "draft nobody" stands, rechecked every few steps. The fade moves a request's rate
        # towards its domain's, which cannot make it pay where not even the best evidence held
        # would (could_pay): there it stands as long as without the fade. A request that joined
        # meanwhile (the only rows with since_draft 0 after a step that drafted nobody) needs the
        # plan only if rows could pay, or if it reads the drafter first (_joined_cold).
        quiet = self._quiet_plan == bs and not due
        stands = QUIET_REPLAN if self.posterior.idle_decay == 1.0 or not pays else QUIET_FADING
        joined = [i for i, s in enumerate(seqs) if s.since_draft == 0] if quiet else []
        if (quiet and self._quiet_steps < stands
                and (not joined or not pays and not self._joined_cold(joined, caps, bs, cost))):
            self._quiet_steps += 1
            self._ran_plain(bs)
            return [], []
        if measured and self._since_plain >= self.plain_wait(bs):
            # A plain probe: while every step drafts someone, no plain step is observed, and the
            # measured cost model can only extrapolate a plain step's price from drafted steps
            # (its "anyone drafted" term is then one with its intercept: OnlineCostModel).
            self._ran_plain(bs)
            return [], []
        if due is None:
            due = due_rows()
        rate, draw, force, lens = (self._plan_on_host if self.host else self._plan_on_device)(bs, caps, cost)
        planned = lens > 1
        chosen = planned | force
        # a row drafted because its draw beat its mean is a trial: it verifies >= min_len slots
        force |= chosen & (draw > rate)
        spend, probes = (0.0 if bool(chosen.any()) else cost.draft_fixed), 0
        for i in sorted((i for i in due if not chosen[i]), key=lambda i: -seqs[i].since_draft):
            if self.credit < spend + row:
                break
            spend, probes = spend + row, probes + 1
            chosen[i] = force[i] = True
        if probes:
            self.credit -= spend
        if measured and bool(chosen.any()) and not bool((planned & ~force).any()):
            # Only forced rows (first reads, probes) draft: the whole drafting is theirs. What it
            # really costs (catch-up of their pending context, the forward, the head, planning)
            # is charged after the step in place of this estimate (see charge_forced).
            self.forced_charge = (spend if probes else 0.0, cost.per_token, cost.draft_fixed + row * bs,
                                  cost.plain_step(bs))
        drafted = [i for i, c in enumerate(chosen.tolist()) if c]
        self._quiet_plan, self._quiet_steps = (None if drafted else bs), 0
        if drafted:
            self._since_plain += 1
        else:
            self._ran_plain(bs)
        return drafted, [i for i in drafted if bool(force[i])]

    def _joined_cold(self, joined: list[int], caps: list[int], bs: int, cost: StepCostModel) -> bool:
        """Whether a plan would give any of the `joined` rows a first read: _cold_reads, asked of
        those rows alone (no history, own or its domain's, a block left to verify, and a
        drafter that is always right could pay here). A posterior on a device is not read here
        (it would sync the host): its rows are planned.

        At mixed c=32, where nothing pays, a request joins every few steps, and each join made a
        plan of the whole batch that drafted nobody: 149 plans in 366 steps before, 99 after, the
        plans' share of a 20 ms step 0.145 ms and 0.082 (benchmarks/adaptive/host_parts/
        mixed_c32_{71c9353,6fce8a2}.json, on an Intel Xeon)."""
        if not self.host:
            return True
        _, known = self.posterior.estimate_on_host(bs)
        cold = np.zeros(bs, dtype=bool)
        cold[joined] = ~known[joined] & (np.asarray(caps, dtype=np.int64)[joined] > 1)
        return bool(self._cold_reads(cold, bs, cost).any())

    def plain_wait(self, bs: int) -> int:
        """Steps in a row that draft anyone before a plain probe at batch size `bs`.

        PLAIN_FIRST at a batch size where no plain step has run yet, doubling with each one that
        has, up to PLAIN_EVERY: so at most 1/(PLAIN_EVERY + 1) of the steps' drafting gain in
        the long run, and a measured plain price early. A cold batch that drafted every row from
        its first steps (a cost model priced from start-up profile alone) otherwise extrapolated
        a plain step at in-domain c=16 from drafted ones for its first 64 steps: 18.6 ms against
        14.0 measured, which kept every row drafted at 0.92x `ar`."""
        return min(PLAIN_EVERY, PLAIN_FIRST << self._plain_seen.get(bs, 0))

    def _ran_plain(self, bs: int) -> None:
        self._since_plain = 0
        seen = self._plain_seen.get(bs, 0)
        if PLAIN_FIRST << seen < PLAIN_EVERY:
            self._plain_seen[bs] = seen + 1

    def _could_pay(self, bs: int, cost: StepCostModel) -> bool:
        """could_pay, asked every step and recomputed when the batch size changes, a posterior
        is set or the plan is voided (replan), else every probe_every steps: it sets how fast
        probe credit grows, which only matters over that many steps, and computing it (about
        0.14 ms) after every drafted step showed at c=1, where a plain step takes 7 ms.

        While the posterior gains no evidence (nobody drafted since), the best evidence it
        holds can only fade, so the answer is kept MAX_PROBE_GAP times as long, rechecked then
        for the cost model's drift: at math c=1, where nothing drafts, the recomputation every
        16 steps took 20 us a step on average (0.32 ms each, timed in place, between the
        target's forwards: benchmarks/adaptive/host_parts/)."""
        post = self.posterior
        memo = self._could_pay_memo
        if memo is None or memo[0] != (bs, id(post)) or memo[2] >= self._could_pay_life(memo, post):
            # the posterior is kept with the answer, so its id cannot be reused meanwhile
            memo = self._could_pay_memo = [(bs, id(post)), self.could_pay(bs, cost), 0, post, post.evidence]
        memo[2] += 1
        return memo[1]

    def _could_pay_life(self, memo: list, post: SurvivalPosterior) -> int:
        """Steps a could_pay answer stands: probe_every, or MAX_PROBE_GAP times that while the
        posterior has gained no evidence since it was computed."""
        return self.probe_every * (MAX_PROBE_GAP if memo[4] == post.evidence else 1)

    def could_pay(self, bs: int, cost: StepCostModel) -> bool:
        """Whether drafting could pay at this batch size for rows as good as the best evidence.

        A probe asks whether a request that drafts nothing has started to accept again. Where a
        batch of `bs` rows, every one with the best survival the posterior knows (of any domain,
        or of a row in the batch; shaped by that domain's profile along the block:
        SurvivalPosterior.best_known), would still run faster plain than drafted at any length,
        only a request better than anything the drafter has shown would make a probe pay: a long
        shot, and probing then costs without changing the plan (at mixed c=64 on the embedded
        pair, probes and their catch-up took about 3% of a run that drafted nothing). Probes then
        get LONG_SHOT_SHARE of their credit, not none: a request that starts repeating itself can
        still be noticed, later. First reads are not affected. (The batch's best row alone was
        tried: at c=1 that is the row itself, which a few failed blocks then left with a quarter
        of its probes, and in-domain c=1 drafted 52% of request-steps at 1.11x `ar`, against 71%
        at 1.15x. A margin of 1 in log-odds over the best evidence was tried too: it was added
        while rows in flight at a hot reload spoiled a new drafter version's first evidence, and
        once that was fixed the demo read 1.49x plain decoding without it, 1.45x with it, and
        mixed c=8 lost 2-3% to it: benchmarks/adaptive/checks/c8_margin*.)
        """
        profile = self.posterior.best_known(bs, self.block_size - 1)
        if profile is None:  # no evidence at all: the bound is a drafter that is always right
            return self.perfect_could_pay(bs, cost)
        return self._pays_with(profile, bs, cost)

    def perfect_could_pay(self, bs: int, cost: StepCostModel) -> bool:
        """Whether drafting could pay at this batch size for rows whose every proposal is
        accepted. Where not even that pays, the step's price alone rules drafting out, whatever
        the drafter: no first read (first_reads) can change the plan. It is only as good as the
        prices: where the fit has seen only a few forced rows drafted at once it may still let
        whole blocks pay (benchmarks/adaptive/first_reads.py measures what a cell does)."""
        return self._pays_with(np.ones(self.block_size - 1, dtype=np.float32), bs, cost)

    def _pays_with(self, profile: np.ndarray, bs: int, cost: StepCostModel) -> bool:
        """Whether `bs` rows whose proposals survive as `profile` [B-1] does would run faster
        drafted at some length >= min_len than plain."""
        lens = np.arange(1, self.block_size + 1, dtype=np.float64)
        gains = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(profile.astype(np.float64)))])
        row_cost = cost.per_token * lens - cost.per_proposal + cost.per_draft * (lens > 1)
        value = bs * gains / (cost.fixed + cost.draft_fixed * (lens > 1) + bs * row_cost)
        return bool(value[min(max(self.min_len, 2), self.block_size) - 1:].max() > value[0])

    # The plan's inputs and the plan, as host arrays for choose's bookkeeping: (rate, draw,
    # force, lengths), each [bs]. It also keeps the plan for the engine (lengths, rate).
    def _plan_on_device(self, bs: int, caps: list[int], cost: StepCostModel):
        cap = torch.tensor(caps, dtype=torch.long)
        slots = torch.arange(bs, device=self.device)
        rate, known = self.posterior.estimate(slots)
        force = self._cold_reads(~known.cpu() & (cap > 1), bs, cost)  # no history at all: read the drafter once
        # with explore, plan with posterior draws: uncertain requests get tried
        draw = self.posterior.sample(slots, self.explore_gen) if self.explore else rate
        per_slot = self.posterior.per_slot(slots, draw, self.block_size - 1)  # the domain's profile along the block
        lens = plan_lengths(per_slot, self.block_size, cost.plan_cost(), min_len=self.min_len,
                            cap=cap.to(self.device), allow_off=(~force).to(self.device))
        self.lengths, self.rate = lens.cpu(), rate
        return rate.cpu(), draw.cpu(), force, self.lengths

    def _plan_on_host(self, bs: int, caps: list[int], cost: StepCostModel):
        """The same on a CPU, in numpy on views of the posterior's tensors: at c=1 the step's
        dozens of tensor operations here cost about 0.5 ms in torch's per-call overhead (of a
        15 ms step) and a fraction of it in numpy. Equal to _plan_on_device (the tests check)."""
        cap = np.asarray(caps, dtype=np.int64)
        rate, known = self.posterior.estimate_on_host(bs)
        force = self._cold_reads(~known & (cap > 1), bs, cost)
        draw = self.posterior.sample(torch.arange(bs), self.explore_gen).numpy() if self.explore else rate
        per_slot = self.posterior.per_slot_on_host(bs, draw, self.block_size - 1)
        lens = plan_on_host(per_slot, self.block_size, cost.plan_cost(), self.min_len, cap, ~force)
        self.lengths, self.rate = torch.from_numpy(lens), torch.from_numpy(rate)
        return rate, draw, force, lens

    def _cold_reads(self, cold, bs: int, cost: StepCostModel):
        """The first reads of this step's cold rows (first_reads), none where not even a
        drafter that is always right could pay at this batch size (perfect_could_pay): the
        rows then plan from no evidence, as drafting nothing, until a probe reads them."""
        if not bool(cold.any()) or self.perfect_could_pay(bs, cost):
            return self.first_reads(cold)
        return cold & False

    def first_reads(self, cold):
        """cold [bs] bool (rows with no history, own or domain's; a tensor or a numpy array)
        -> the rows to read now, of the same kind.

        At most FIRST_READS cold rows of each domain read the drafter in one step. The others
        plan as drafting nothing for one step and then start from what their domain's reads
        showed: a cold wave of 64 requests of a domain the drafter fails on pays four drafter
        rows, not 64 (a step drafting all 64 costs several plain steps on the embedded pair).
        """
        rows = [i for i, c in enumerate(cold.tolist()) if c]
        if len(rows) <= FIRST_READS:
            return cold
        domains = self.posterior.slot_domain[: len(cold)].tolist()
        taken: dict[int, int] = {}
        for i in rows:
            if taken.get(domains[i], 0) >= FIRST_READS:
                cold[i] = False
            else:
                taken[domains[i]] = taken.get(domains[i], 0) + 1
        return cold

    def charge_forced(self, spec: DraftedStep, proposals: int, verify_seconds: float | None = None) -> None:
        """A step that drafted only forced rows pays its measured drafting time, and the verify
        slots of their proposals, from the probe credit (less what the plan already took); on a
        step that drafts anyway, forced rows pay their rows' price and their measured catch-up.
        Given the step's measured verify time, the proposals pay whatever the step verified
        beyond a plain step's price, when that is more than their slots' price: one row of two
        tokens among single-token rows takes the target's ragged attention path, which on the
        embedded pair cost more than the drafter forward itself, and went unpaid.
        So probes and first reads together keep to `probe_share` of the time as it is measured,
        not as the cost model guessed it. The debt is bounded, so a long cold start delays
        probes for a while, not for good. With a fixed cost model (given, not measured) its
        prices are the only currency, and this charges nothing."""
        if self.forced_charge is None or not spec.drafted:
            self.credit -= spec.forced_catch_up_seconds
            return
        paid, per_token, bound, plain = self.forced_charge
        self.forced_charge = None
        verify = per_token * proposals
        if verify_seconds is not None:
            verify = max(verify, verify_seconds - plain)
        cost = spec.draft_seconds + verify
        self.credit = max(self.credit - (cost - paid), -bound)

    def next_probe_gap(self, gap: int, accepted_nothing: bool) -> int:
        """A probe that accepted nothing waits twice as long for the next (up to MAX_PROBE_GAP
        times probe_every); one that accepted resets the wait."""
        if not accepted_nothing:
            return self.probe_every
        return min(2 * max(gap, self.probe_every), MAX_PROBE_GAP * self.probe_every)
