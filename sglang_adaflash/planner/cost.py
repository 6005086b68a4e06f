"""The engine's side of AdaFlash's load-aware verify-length rule: its step cost model.

The rule itself (which lengths maximise expected committed tokens per second, drafting a request
or not) lives in :mod:`sglang_adaflash.planner`, shared with the SGLang plugin; this module
prices a step for it, from a start-up profile refitted online from the engine's own steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lengths import PlanCost, plan_lengths, survival_rate

__all__ = ["OnlineCostModel", "StepCostModel", "choose_verify_lengths", "survival_rate"]


@dataclass(frozen=True)
class StepCostModel(PlanCost):
    """Seconds per decode step: fixed + per_token * verified tokens, plus what drafting costs:
    draft_fixed when anyone drafts and per_draft for every drafted request (0: drafting is free,
    which keeps every request drafted). The planner's `PlanCost`, under the engine's name."""

    def plan_cost(self) -> PlanCost:
        return PlanCost(self.fixed, self.per_token, self.per_draft, self.draft_fixed, self.per_proposal)


class OnlineCostModel:
    """The step cost model, refitted from the engine's own step timings as it serves.

    A profile taken once at start-up cannot know the context lengths, batch mix and machine load
    the engine will meet, and the rule is only as good as its cost model. The engine times the
    two phases of a step apart, and each phase gets its own exponentially weighted ridge fit
    with the profile as the ridge's centre:

        verify seconds = a + b * batch_size + c * verified_tokens
                         + w * [anyone drafted] + v * drafted                     (every step)
        draft seconds  = e + d * drafted + g * proposals                          (steps that draft)

    Both fits weigh their evidence by its age in steps, the drafting fit's included while
    nothing drafts (observe says why): evidence nothing renews fades towards the profile.

    Fitting the drafter's cost from its own timings, rather than out of whole-step times,
    keeps what drafting costs from being confused with what the batch costs anyway: in one
    regression over whole steps the two move together (a step drafts more requests when it
    holds more), and a noisy machine can then price the drafter forward at ten times its real
    time and switch off requests whose drafts pay. The batch-size term keeps costs that grow
    with the batch but not with the verify lengths (attention over every context) out of the
    per-token price. The last two terms price what drafting costs the verify beyond its tokens: on a
    CPU a batch with a multi-token row leaves the one padded attention call of a plain step for the
    target's ragged path (each multi-token row its own call per layer). Measured on the embedded
    pair at 8 rows of 120 cached tokens (benchmarks/adaptive/verify_shape.py): plain 9.8 ms, one row
    verifying 4 slots 11.8, every row 4 slots 15.2 (+0.7 ms a row: equal lengths keep one padded
    call). Without them a plain step's price was extrapolated from drafted steps and came out 20-45%
    high once every row drafted, which kept every row drafted. While every row drafts at one batch
    size, w and v cannot be told from a and b; the plain steps the draft-or-not choice runs now and
    then (`draft_choice.plain_wait`) are what identify them. A row's backlog catch-up is kept out of
    the drafting fit (the engine's `_catch_up` says why).
    For a batch of n requests the rule sees fixed = a + b * n, per_token = c + g, per_proposal =
    g (what a bonus token does not pay: it has no proposal's LM head), per_draft = d + v and
    draft_fixed = e + w.
    """

    _SCALE = (1.0, 64.0, 1024.0)  # feature scales (the drafting fit)
    _VERIFY_SCALE = (1.0, 64.0, 1024.0, 1.0, 64.0)  # 1, n, tokens, anyone drafted, drafted

    def __init__(self, prior: StepCostModel, *, decay: float = 0.97, prior_weight: float = 1e-3, warmup: int = 8):
        self.decay = decay
        self._verify = _Ridge([prior.fixed, 0.0, prior.per_token, 0.0, 0.0], self._VERIFY_SCALE, prior_weight, decay, warmup)
        self._draft = _Ridge([prior.draft_fixed, prior.per_draft, 0.0], self._SCALE, prior_weight, decay, warmup)
        self._memo: tuple[tuple[int, int, int], StepCostModel] | None = None

    def observe(
        self,
        batch_size: int,
        tokens: int,
        seconds: float,
        drafted: int | None = None,
        draft_seconds: float | None = None,
        proposals: int | None = None,
        multi: int | None = None,
    ) -> None:
        """One step: its verify phase took `seconds`; `draft_seconds` its drafting, when it
        drafted `drafted` requests for `proposals` proposals (default: every request, the rest
        of the verified tokens). `multi`: the rows that verified more than their bonus token
        (default: the drafted ones), which is what the verify's w and v terms price; a drafted
        row that a trim left with its bonus token alone (planner.confidence) verifies as a
        plain row does."""
        drafted = batch_size if drafted is None else drafted
        multi = drafted if multi is None else multi
        self._verify.observe([1.0, batch_size, tokens, float(multi > 0), multi], seconds)
        if drafted > 0 and draft_seconds is not None:
            proposals = tokens - batch_size if proposals is None else proposals
            self._draft.observe([1.0, drafted, proposals], draft_seconds)
        else:
            # The drafting fit's evidence ages with the engine's steps, not with its own
            # observations: otherwise a price a burst of load inflated stood for as long as
            # nothing drafted, and at that price nothing drafted (probes are paid at it, so they
            # came rarely, and each weighed one observation against the burst's dozen). Measured
            # with benchmarks/adaptive/lockout.py: at in-domain c=1 the engine drafted 11% of
            # request-steps after twelve drafted steps at four times the fitted price, against 68%
            # without them. Aged this way, evidence nothing renews fades towards the start-up
            # profile (the ridge's centre) within a few hundred steps, and the first probe after a
            # burst outweighs it.
            self._draft.idle()

    def _parts(self) -> tuple[float, ...]:
        """(a, b, c, w, v, e, d, g) as the fits stand, each collinear pair's negative part handed
        back to its partner (model() says why)."""
        a, b, c, w, v = self._verify.solve()
        e, d, g = self._draft.solve()
        return a, b, c, w, v, e, d, g

    def model(self, batch_size: int) -> StepCostModel:
        parts = self._parts()  # solves a fit that is due: the memo's key reads the solve counts
        key = (batch_size, self._verify.solves, self._draft.solves)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        a, b, c, w, v, e, d, g = self._clamped(parts, batch_size)
        # g: the drafter's LM head per proposal, which a row's bonus token does not pay. Charged
        # on every row, it once priced a plain step at in-domain c=32 at about twice its measured
        # time, in a run that drafted nearly every row (docs/engine.md).
        g = max(g, 0.0)
        per_token = max(c + g, 1e-9)
        out = StepCostModel(
            fixed=max(a + b * batch_size, 0.0),
            per_token=per_token,
            per_proposal=min(g, per_token * (1 - 1e-6)),
            per_draft=d + v,
            draft_fixed=max(e, 0.0) + w,
        )
        self._memo = (key, out)  # asked every step, it changes only when a fit is re-solved
        return out

    def trim_cost(self, batch_size: int, drafted: int) -> PlanCost:
        """The price of a step's verify once its `drafted` rows are drafted and their proposals
        read (planner.confidence.trim_lengths): the drafter forward, its LM head and the plain
        step are paid; a verified token costs the target's c; what the verify pays for leaving
        the single-token path is not paid yet. It is paid only if some row verifies more than its
        bonus token (w: PlanCost.draft_fixed) and per such row (v: PlanCost.per_draft): on a CPU
        at c=1, one row verifying two tokens took 10.5 ms against a plain step's 7.6
        (benchmarks/adaptive/avx2/foresight_in_domain_c1.json), which a trim that takes it as
        sunk never saves."""
        a, b, c, w, v, e, d, _ = self._clamped(self._parts(), batch_size)
        sunk = max(a + b * batch_size, 0.0) + max(e, 0.0) + d * drafted
        return PlanCost(fixed=sunk, per_token=max(c, 1e-9), per_draft=v, draft_fixed=w)

    @staticmethod
    def _clamped(parts: tuple[float, ...], batch_size: int) -> tuple[float, ...]:
        """The fits' parts (a, b, c, w, v, e, d, g) with the negative ones handed back.

        A negative part is its collinear partner's share (b while the batch size never changes,
        w while every step drafts): it goes back to that partner, so the observed steps keep
        their fitted time. A negative v (drafted rows making the verify cheaper) is the fit's
        noise and is dropped; g is left as fitted (model() decides what it charges)."""
        a, b, c, w, v, e, d, g = parts
        a, w = a + min(w, 0.0), max(w, 0.0)
        a, b = a + min(b, 0.0) * batch_size, max(b, 0.0)
        e, d = e + min(d, 0.0), max(d, 0.0)
        return a, b, c, w, max(v, 0.0), e, d, g


class _Ridge:
    """Exponentially weighted ridge regression towards a prior, solved lazily when asked.

    Three features (drafting) or five (verify): the sufficient statistics are k * k plus k floats,
    updated in plain Python (a few hundred nanoseconds; the engine pays this on every step, drafting
    or not, and even numpy's per-call overhead showed in the profile of a 4 ms step). The solve runs
    in plain Python too (_solve_small), after every `refit_every` new observations, not after each:
    one step moves an exponentially weighted fit very little.
    """

    refit_every = 4
    idle_fold = 16  # steps a fit may go unobserved before their ageing is folded in (idle)

    def __init__(self, centre, scale, prior_weight, decay, warmup):
        self.scale = [float(v) for v in scale]
        self.decay, self.warmup = decay, warmup
        self.centre = [float(c) * sc for c, sc in zip(centre, self.scale)]  # in scaled features
        k = len(centre)
        self.ridge_weight = float(prior_weight)  # the ridge: prior_weight times the identity
        self.xtx = [0.0] * (k * k)  # row-major k x k
        self.xty = [0.0] * k
        self.theta = list(self.centre)
        self.seen, self.stale, self._solved_at = 0, False, -self.refit_every
        self.clock = 0  # steps seen: observed and idle (the refit cadence counts both)
        self._idle = 0  # idle steps whose ageing is not folded into the statistics yet
        self.solves = 0  # how many times the fit was re-solved (what a cached model is keyed by)
        self._out = [t / sc for t, sc in zip(self.theta, self.scale)]

    def observe(self, features, seconds: float) -> None:
        x = [f / s for f, s in zip(features, self.scale)]
        dec, k = self.decay ** (1 + self._idle), len(x)
        self.xtx = [dec * v + x[i // k] * x[i % k] for i, v in enumerate(self.xtx)]
        self.xty = [dec * v + xi * seconds for v, xi in zip(self.xty, x)]
        self._idle = 0
        self.seen += 1
        self.clock += 1
        self.stale = self.seen >= self.warmup  # a handful of steps cannot separate the terms

    def idle(self) -> None:
        """A step this fit had nothing to observe: its evidence ages by one step's decay, so that
        the ridge's centre regains weight while nothing renews the evidence. Folded in every
        idle_fold such steps (and by the next observation): a plain step pays an increment."""
        self.clock += 1
        self._idle += 1
        if self._idle >= self.idle_fold:
            dec = self.decay ** self._idle
            self.xtx = [dec * v for v in self.xtx]
            self.xty = [dec * v for v in self.xty]
            self._idle = 0
            self.stale = self.seen >= self.warmup

    def solve(self) -> list[float]:
        if self.stale and self.clock - self._solved_at >= self.refit_every:
            k = len(self.xty)
            lam = self.ridge_weight
            a = [[self.xtx[i * k + j] + (lam if i == j else 0.0) for j in range(k)] for i in range(k)]
            b = [self.xty[i] + lam * self.centre[i] for i in range(k)]
            self.theta = _solve_small(a, b)
            self.stale, self._solved_at = False, self.clock
            self.solves += 1
            self._out = [t / sc for t, sc in zip(self.theta, self.scale)]
        return self._out


def _solve_small(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a small dense system (here 3 x 3 or 5 x 5, symmetric positive definite
    with the ridge), by Gaussian elimination with partial pivoting in plain Python.

    numpy's solve takes about 6 microseconds on this size in a tight loop, but between a target's
    forwards (its code and data out of the CPU's caches) it cost far more: with the verify fit
    refitting every fourth step, the fits' solves took 34 microseconds a step on average on the
    embedded pair at math c=8 (timed around the methods), 0.7% of a step that drafts nobody, and
    9.5 in plain Python. a and b are overwritten."""
    k = len(b)
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if a[piv][col] == 0.0:
            raise ZeroDivisionError("singular system")  # the ridge keeps the matrix positive definite
        if piv != col:
            a[col], a[piv] = a[piv], a[col]
            b[col], b[piv] = b[piv], b[col]
        inv = 1.0 / a[col][col]
        row = a[col]
        for r in range(col + 1, k):
            f = a[r][col] * inv
            if f:
                ar = a[r]
                for j in range(col, k):
                    ar[j] -= f * row[j]
                b[r] -= f * b[col]
    x = [0.0] * k
    for i in range(k - 1, -1, -1):
        acc = b[i] - sum(a[i][j] * x[j] for j in range(i + 1, k))
        x[i] = acc / a[i][i]
    return x


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
        PlanCost(cost.fixed, cost.per_token, per_proposal=cost.per_proposal),
        min_len=min_len,
        cap=max_len,
        allow_off=False,
    )
    return lens.to(ratio.device)
