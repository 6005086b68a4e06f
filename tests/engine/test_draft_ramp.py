"""Drafting many rows at once comes after drafting a few: the plan's row count ramps up.

A plan for a whole batch reads prices the cost fit has not seen at that scale and acceptance its
domain has shown only through the drafter's own eval. At mixed c=32 on the embedded pair such a
plan drafted 21-29 rows in one step now and then, at four to five times a plain step's time,
and the evidence that step gave stopped drafting again (DraftChoice.ramp_cap). So with a
measured cost model a step's plan drafts at most twice the rows of the last drafted step (a few
when there was none lately); with a given one (its prices are the caller's) the plan stands.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang_adaflash.engine import draft_choice
from sglang_adaflash.engine.draft_choice import DraftChoice
from sglang_adaflash.planner import SurvivalPosterior
from sglang_adaflash.planner.cost import StepCostModel

BS = 32
# drafting is cheap beside a step's fixed part: every row that accepts pays drafted
CHEAP = StepCostModel(fixed=0.05, per_token=0.0001, per_draft=0.0001, draft_fixed=0.0005)


def _choice(host: bool = True, accepted=None) -> DraftChoice:
    """A batch of BS rows of one domain, row i accepting accepted[i] of 15 proposals every block
    (default: the higher the row, the more; the last four the most, in order)."""
    accepted = [2 + i // 3 for i in range(BS - 4)] + [12, 13, 14, 15] if accepted is None else accepted
    post = SurvivalPosterior(BS)
    post.host = host
    post.reset(torch.arange(BS), ["d"] * BS)
    for _ in range(10):
        post.observe(torch.arange(BS), torch.full((BS,), 0.5),
                     torch.tensor(accepted).clamp(max=15), torch.full((BS,), 16))
    choice = DraftChoice(post, 16, 2, "cpu", probe_share=0.0)
    choice.host = host
    return choice


def _seqs(n: int = BS):
    return [SimpleNamespace(since_draft=1, probe_gap=0) for _ in range(n)]


def _choose(choice: DraftChoice, measured: bool = True, n: int = BS):
    drafted, forced = choice.choose(_seqs(n), [16] * n, CHEAP, measured=measured)
    assert not forced
    return drafted


@pytest.mark.parametrize("host", [True, False])
def test_a_batch_that_pays_is_drafted_a_few_rows_first_then_doubling(host):
    choice = _choice(host)
    counts = [len(_choose(choice)) for _ in range(5)]
    assert counts == [4, 8, 16, 32, 32]


@pytest.mark.parametrize("host", [True, False])
def test_the_rows_kept_are_the_best_and_the_plan_the_engine_reads_agrees(host):
    """The cut keeps the rows with the best survival; a row cut verifies its bonus token alone
    in the plan the engine drafts by (DraftChoice.lengths)."""
    choice = _choice(host)
    drafted = _choose(choice)
    assert drafted == list(range(BS - 4, BS))
    lengths = choice.lengths.tolist()
    assert all(n > 1 for i, n in enumerate(lengths) if i in drafted)
    assert all(n == 1 for i, n in enumerate(lengths) if i not in drafted)


def test_after_a_pause_the_ramp_starts_again():
    """A drafted step's row count is the ramp's base for RAMP_MEMORY steps: drafting resumed
    after a longer pause starts from a few rows again, and so does a new drafter version."""
    choice = _choice()
    for _ in range(4):
        _choose(choice)
    assert choice.ramp_cap() == 64
    for _ in range(draft_choice.RAMP_MEMORY):
        choice._ramp_age += 1  # steps that drafted nobody
    assert len(_choose(choice)) == draft_choice.RAMP_FLOOR
    _choose(choice)
    choice.replan()  # what drafter_swapped calls
    assert len(_choose(choice)) == draft_choice.RAMP_FLOOR


def test_a_given_cost_model_plans_the_whole_batch():
    """Control: prices the caller gives are not extrapolated, and the plan drafts every row that
    pays from the first step."""
    assert len(_choose(_choice(), measured=False)) == BS


def test_a_plan_under_the_cap_stands():
    """Two rows that pay among rows that accept nothing: the plan drafts them, no more."""
    choice = _choice(accepted=[0] * (BS - 2) + [15, 15])
    assert _choose(choice) == [BS - 2, BS - 1]


def test_due_probes_ride_along_only_as_far_as_the_ramp_allows():
    """Probes ride along with planned rows at their rows' price, which a fit that has seen only
    steps of a few rows can put far too low: they count against the ramp too, and the rest wait
    for a later step. Control: with a given cost model every due probe the credit covers rides."""
    def step(measured: bool) -> list[int]:
        choice = _choice(accepted=[0] * (BS - 2) + [15, 15])
        choice.probe_share = 1.0
        choice.credit = 1.0  # covers every due probe
        seqs = [SimpleNamespace(since_draft=40, probe_gap=0) for _ in range(BS)]
        drafted, forced = choice.choose(seqs, [16] * BS, CHEAP, measured=measured)
        assert set(drafted) - set(forced) == {BS - 2, BS - 1}
        return forced

    assert len(step(measured=True)) == draft_choice.RAMP_FLOOR - 2
    assert len(step(measured=False)) == BS - 2


def test_a_step_of_probes_alone_ramps_too():
    choice = _choice(accepted=[0] * BS)
    choice.probe_share, choice.credit = 1.0, 1.0
    seqs = [SimpleNamespace(since_draft=40, probe_gap=0) for _ in range(BS)]
    counts = []
    for _ in range(3):
        drafted, forced = choice.choose(seqs, [16] * BS, CHEAP, measured=True)
        assert drafted == forced
        counts.append(len(forced))
        choice.credit = 1.0
        for i in drafted:
            seqs[i].since_draft = 0
    assert counts == [4, 8, 16]
