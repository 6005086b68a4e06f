"""The lock-in a measured cost model fell into once every row drafted, and what keeps it out.

With every row of a batch drafted at one batch size, no plain step is observed, so a plain
step's price is extrapolated from drafted steps; on a CPU a drafted row costs the verify an
attention call of its own, which a plain step's rows share, and the extrapolation came out high
enough to keep every row drafted where drafting did not pay (benchmarks/adaptive/between/,
in-domain c=16). The cost model has a drafted-rows term in its verify fit, and the draft-or-not
choice runs a plain step now and then (PLAIN_FIRST drafting steps after the first plain step at
a batch size, the wait doubling up to PLAIN_EVERY), which identifies it.
"""

from types import SimpleNamespace

import torch

from sglang_adaflash.engine.draft_choice import PLAIN_EVERY, PLAIN_FIRST, DraftChoice
from sglang_adaflash.planner import SurvivalPosterior
from sglang_adaflash.planner.cost import OnlineCostModel, StepCostModel

BS = 16
# the verify phase's true price: 2 ms + 0.3 ms a row + 0.1 ms a token, and when anyone drafts
# 2 ms + 0.2 ms a drafted row (the shape measured on the embedded pair: docs in planner/cost.py)
A, B, C, W, V = 0.002, 0.0003, 0.0001, 0.002, 0.0002
PLAIN = A + B * BS + C * BS  # 8.4 ms


def _drafted_steps(model: OnlineCostModel, steps: int, *, plain_every: int | None, seed: int = 0) -> None:
    """Every row drafted at BS rows (3-5 slots each) but on every 8th step, which drafts 1-3 rows
    (probes, first reads), a plain step every `plain_every` steps, the verify timed with a shared
    machine's jitter; drafting timed at 1 ms + 0.5 ms a row."""
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        plain = plain_every is not None and step % (plain_every + 1) == 0
        drafted = 0 if plain else int(torch.randint(1, 4, (1,), generator=g)) if step % 8 == 0 else BS
        tokens = BS + sum(int(torch.randint(2, 5, (1,), generator=g)) for _ in range(drafted))
        noise = float(torch.randn(1, generator=g)) * 0.0003
        verify = A + B * BS + C * tokens + (W + V * drafted if drafted else 0.0) + noise
        model.observe(BS, tokens, verify, drafted=drafted,
                      draft_seconds=(0.001 + 0.0005 * drafted) if drafted else None,
                      proposals=tokens - BS)


def test_a_plain_step_now_and_then_keeps_the_plain_price_measured():
    """Steps at the engine's cadence (one plain step after PLAIN_EVERY drafted ones): the plain
    step's price is within 4% of its true 8.4 ms, and drafting is priced what it costs the verify
    too (its fixed part and its part per row, within 25%). Control: with no plain step (the
    lock-in), "anyone drafted" cannot be told from the intercept, and the plain price comes out
    over 6% high, carrying part of what drafting costs the verify."""
    profile = StepCostModel(fixed=0.006, per_token=0.0001, per_draft=0.0005, draft_fixed=0.001)
    for seed in range(3):
        probed, locked = OnlineCostModel(profile), OnlineCostModel(profile)
        _drafted_steps(probed, 400, plain_every=PLAIN_EVERY, seed=seed)
        _drafted_steps(locked, 400, plain_every=None, seed=seed)
        fit = probed.model(BS)
        assert abs(fit.plain_step(BS) - PLAIN) < 0.04 * PLAIN, (seed, fit)
        assert abs(fit.per_draft - (0.0005 + V)) < 0.25 * (0.0005 + V), (seed, fit)
        assert abs(fit.draft_fixed - (0.001 + W)) < 0.25 * (0.001 + W), (seed, fit)
        assert locked.model(BS).plain_step(BS) > 1.06 * PLAIN, (seed, locked.model(BS))


def _choice_that_drafts_everyone(bs: int) -> tuple[DraftChoice, list, list[int], StepCostModel]:
    post = SurvivalPosterior(bs)
    post.reset(torch.arange(bs), ["code"] * bs)
    for _ in range(20):  # every row accepts nearly whole blocks
        post.observe(torch.arange(bs), torch.full((bs,), 0.9), torch.full((bs,), 14), torch.full((bs,), 16))
    seqs = [SimpleNamespace(since_draft=0, probe_gap=16) for _ in range(bs)]
    cost = StepCostModel(fixed=0.01, per_token=0.0002, per_draft=0.0002, draft_fixed=0.001)
    return DraftChoice(post, 16, 2, "cpu"), seqs, [16] * bs, cost


def _plain_steps(waits: list[int]) -> list[int]:
    """The indices of plain steps when the k-th plain probe follows waits[k] drafting steps."""
    out, at = [], -1
    for w in waits:
        at += w + 1
        out.append(at)
    return out


def test_the_choice_runs_plain_probes_early_and_then_every_plain_every_steps():
    """A batch whose drafts pay is drafted whole every step, except plain probes: the first
    after PLAIN_FIRST steps, the wait doubling up to PLAIN_EVERY; with the profile's (unmeasured)
    cost model there is nothing to measure and no plain step. Control: the steps the measured
    choice drafts nobody are exactly those."""
    waits = [8, 16, 32, 64, 64, 64]
    assert PLAIN_FIRST == 8 and PLAIN_EVERY == 64
    choice, seqs, caps, cost = _choice_that_drafts_everyone(4)
    plain = [i for i in range(sum(waits) + len(waits)) if not choice.choose(seqs, caps, cost, measured=True)[0]]
    assert plain == _plain_steps(waits)
    choice, seqs, caps, cost = _choice_that_drafts_everyone(4)
    assert all(choice.choose(seqs, caps, cost, measured=False)[0] == [0, 1, 2, 3]
               for _ in range(2 * PLAIN_EVERY + 2))


def test_each_batch_size_gets_its_early_plain_probes():
    """The schedule is per batch size (a plain price measured at 4 rows says little of 16):
    after the waits at 4 rows reached PLAIN_EVERY, a batch of 3 rows starts at PLAIN_FIRST.
    A plain step the plan chose itself counts as one seen."""
    choice, seqs, caps, cost = _choice_that_drafts_everyone(4)
    for _ in range(8 + 16 + 32 + 3):
        choice.choose(seqs, caps, cost, measured=True)
    assert choice.plain_wait(4) == PLAIN_EVERY
    assert choice.plain_wait(3) == PLAIN_FIRST
    choice.choose(seqs[:3], [1, 1, 1], cost, measured=True)  # nobody can draft: a plain step at 3 rows
    assert choice.plain_wait(3) == 2 * PLAIN_FIRST


def test_a_batch_that_drafts_some_rows_every_step_gets_its_plain_probe_too():
    """Steps that draft some rows and not others cannot tell "anyone drafted" from the intercept
    either: they count towards the plain probe as whole-batch drafting does. Control: a step that
    drafts nobody (here every row's cap is 1) restarts the count."""
    choice, seqs, caps, cost = _choice_that_drafts_everyone(4)
    some = [1, 16, 16, 16]  # row 0 cannot draft (its cap is 1)
    waits = [8, 16, 32, 64]
    plain = [i for i in range(sum(waits) + len(waits)) if not choice.choose(seqs, some, cost, measured=True)[0]]
    assert plain == _plain_steps(waits)
    choice, seqs, caps, cost = _choice_that_drafts_everyone(4)
    for _ in range(3):  # three plain steps seen at 4 rows: the wait is PLAIN_EVERY from here
        choice.choose(seqs, [1] * 4, cost, measured=True)
    assert choice.plain_wait(4) == PLAIN_EVERY
    for i in range(2 * PLAIN_EVERY):
        none = i % 50 == 49
        drafted, _ = choice.choose(seqs, [1] * 4 if none else caps, cost, measured=True)
        assert drafted == ([] if none else [0, 1, 2, 3]), i


def test_a_cold_batch_that_drafts_every_row_has_its_plain_price_measured_within_forty_steps():
    """A batch drafted whole from its first step, with the start-up profile as its only prior (no
    "anyone drafted" term): the choice's early plain probes (after 8 and then 16 drafting steps)
    measure the plain price within 8% by step 40. Control: with one plain probe after
    PLAIN_EVERY steps alone (the old schedule), none has run by then and the price is
    extrapolated high."""
    profile = StepCostModel(fixed=0.006, per_token=0.0001, per_draft=0.0005, draft_fixed=0.001)
    choice, seqs, caps, cost = _choice_that_drafts_everyone(BS)
    plain_at = {i for i in range(40) if not choice.choose(seqs, caps, cost, measured=True)[0]}
    assert plain_at == set(_plain_steps([8, 16]))
    for seed in range(3):
        _cold_start(profile, plain_at, seed)


def _cold_start(profile: StepCostModel, plain_at: set[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    early, late = OnlineCostModel(profile), OnlineCostModel(profile)
    for step in range(40):
        tokens = BS + sum(int(torch.randint(2, 5, (1,), generator=g)) for _ in range(BS))
        noise = float(torch.randn(1, generator=g)) * 0.0003
        drafted = A + B * BS + C * tokens + W + V * BS + noise
        late.observe(BS, tokens, drafted, drafted=BS, draft_seconds=0.001 + 0.0005 * BS, proposals=tokens - BS)
        if step in plain_at:
            early.observe(BS, BS, PLAIN + noise, drafted=0)
        else:
            early.observe(BS, tokens, drafted, drafted=BS, draft_seconds=0.001 + 0.0005 * BS, proposals=tokens - BS)
    assert abs(early.model(BS).plain_step(BS) - PLAIN) < 0.08 * PLAIN, (seed, early.model(BS))
    assert late.model(BS).plain_step(BS) > 1.15 * PLAIN, (seed, late.model(BS))
