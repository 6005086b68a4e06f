"""Length head -> verify lengths -> ragged layout, on CPU tensors with SGLang's own layout helpers.

The packed verify, scatter-back and capped acceptance run inside SGLang's real decode step in
``test_sglang_cpu_engine.py`` (Triton kernels interpreted and torch references).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang_adaflash.drafter.length_head import AdaptiveLengthHead  # noqa: E402
from sglang_adaflash.planner.cost import StepCostModel  # noqa: E402
from sglang_adaflash.sglang_plugin import length_budget as lb  # noqa: E402


def test_host_budget_rounds_the_lagged_total_up_to_a_captured_bucket():
    """The host's total comes from host values only: the lagged mean times the batch size,
    within the requests' floors and caps, rounded up to a captured token bucket (whose spare
    tokens are verified too); batches above the captured sizes run on exact tokens."""
    budget = lb.plan_host_budget(
        block_size=8, min_len=2, remaining=[20, 20, 3], bs=3, mean_len=3.4, grid=[8, 16, 24]
    )
    assert budget.cap == [8, 8, 3] and budget.lo == [2, 2, 2]
    assert budget.graph_num_tokens == 16 and budget.total == 16  # round(10.2) -> bucket 16
    above = lb.plan_host_budget(
        block_size=8, min_len=2, remaining=None, bs=4, mean_len=7, grid=[8, 16, 24], max_slots=3
    )
    assert above.graph_num_tokens == above.total == 28  # 4 requests > 3 captured slots: eager
    # the bucket never asks for more than the requests may verify
    tight = lb.plan_host_budget(
        block_size=8, min_len=2, remaining=[2, 2], bs=2, mean_len=8, grid=[16]
    )
    assert tight.total == 4 and tight.graph_num_tokens == 16
    # sampled requests verify whole blocks
    sampled = lb.plan_host_budget(
        block_size=8, min_len=2, remaining=None, bs=2, mean_len=1, sampled=[True, False]
    )
    assert sampled.lo == [8, 2] and sampled.total == 10


def test_fit_to_total_gives_the_spare_slots_to_the_likeliest_requests():
    survival = torch.tensor([0.9, 0.5, 0.0, 0.9])
    lo, cap = torch.tensor([2, 2, 2, 1]), torch.tensor([8, 8, 8, 3])
    lens = lb.fit_to_total(survival, lo, cap, 14, 8)
    assert int(lens.sum()) == 14 and (lens >= lo).all() and (lens <= cap).all()
    assert lens.tolist() == [7, 2, 2, 3]  # 0.9^s beats 0.5^1 until s = 7; request 3 is capped
    # against brute force on small cases: the split maximises sum_i sum_{s<L_i} a_i^s
    import itertools

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = torch.rand(3, generator=g)
        lo, cap = torch.tensor([1, 2, 1]), torch.tensor([4, 4, 3])
        total = int(torch.randint(4, 12, (1,), generator=g))
        got = lb.fit_to_total(a, lo, cap, total, 4)

        def value(lens, a=a):
            return sum(sum(float(a[i]) ** s for s in range(n)) for i, n in enumerate(lens))

        best = max(
            value(c)
            for c in itertools.product(range(1, 5), range(2, 5), range(1, 4))
            if sum(c) == total
        )
        assert int(got.sum()) == total
        assert abs(value(got.tolist()) - best) < 1e-5, (a, total, got)


def test_uniform_plan_is_whole_blocks_known_on_the_host():
    plan = lb.VerifyPlan.uniform(3, 4, "sampling")
    assert plan.is_uniform and plan.num_verify_tokens == 12 and plan.total_host == 12
    layout = lb.verify_layout(plan.lengths, total=12, graph_num_tokens=16)
    assert layout.graph_num_tokens == 16 and layout.total_verify_tokens == 12
    cand = torch.arange(12).view(3, 4)
    assert torch.equal(lb.cap_candidates(cand, plan.lengths), cand)


def test_lagged_mean_reads_what_landed():
    lag = lb.LaggedMean(16.0)
    assert lag.read() == 16.0
    lag.push(torch.tensor([4, 6]))
    assert lag.read() == 5.0


def test_plan_bounds():
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        lb.VerifyPlan.from_lists([0, 5], 4)


def _head(bias: float) -> AdaptiveLengthHead:
    head = AdaptiveLengthHead(16, 8)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(bias)  # ratio = sigmoid(bias) whatever the states
    return head


def test_planner_follows_head_and_load():
    block = 8
    cheap_tokens = StepCostModel(fixed=1.0, per_token=1e-6)  # small batch regime
    dear_tokens = StepCostModel(fixed=1e-3, per_token=1e-3)  # large batch regime
    hidden = torch.randn(4 * block, 16)
    quarter = torch.logit(torch.tensor(0.25)).item()

    def planner(bias, cost, rule="load_aware", min_len=2):
        return lb.VerifyPlanner(_head(bias), block, rate=1.3, min_len=min_len, cost=cost, rule=rule)

    # ratio ~ 1: the head expects whole blocks accepted, both rules verify them
    assert planner(8.0, cheap_tokens).plan(hidden, 4, greedy=True).verify_lens_cpu == [8] * 4
    assert planner(8.0, None, "paper").plan(hidden, 4, greedy=True).verify_lens_cpu == [8] * 4
    # ratio 0.25, paper rule: round(0.25 * 8 * 1.3) = 3 for every request
    plan = planner(quarter, None, "paper").plan(hidden, 4, greedy=True)
    assert plan.verify_lens_cpu == [3] * 4 and plan.reason == "head"
    # load-aware: cheap tokens -> whole blocks; dear tokens -> short, never below min_len
    assert planner(quarter, cheap_tokens).plan(hidden, 4, greedy=True).verify_lens_cpu == [8] * 4
    lean = planner(quarter, dear_tokens).plan(hidden, 4, greedy=True).verify_lens_cpu
    assert all(2 <= n < 8 for n in lean), lean
    # the same decisions as the reference engine's rule on the same ratio
    from sglang_adaflash.planner.cost import choose_verify_lengths

    ratio = torch.full((4,), 0.25)
    assert lean == choose_verify_lengths(ratio, block, dear_tokens, min_len=2).tolist()
    # per-request caps (tokens a request may still generate)
    capped = planner(8.0, cheap_tokens).plan(hidden, 4, greedy=True, max_len=[8, 3, 1, 20])
    assert capped.verify_lens_cpu == [8, 3, 1, 8]
    # sampled batches and missing states verify whole blocks
    assert planner(8.0, cheap_tokens).plan(hidden, 4, greedy=False).reason == "sampling"
    assert planner(quarter, cheap_tokens).plan(None, 4, greedy=True).is_uniform
    no_head = lb.VerifyPlanner(None, block, rate=1.3, min_len=2, cost=dear_tokens)
    assert no_head.plan(hidden, 4, greedy=True).is_uniform
    with pytest.raises(ValueError, match="length rule"):
        lb.VerifyPlanner(None, block, rate=1.3, min_len=2, cost=None, rule="magic")


def test_plugin_plans_are_the_engines_on_cpu_tensors():
    """The plugin's planner and the reference engine's step run the same planner: for the same
    block states, head and cost they choose the same lengths. Control: the paper rule differs."""
    from sglang_adaflash.engine.engine import SpecBatch, SpecEngine
    from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

    target, drafter = tiny_target(), tiny_drafter()
    block, cfg = drafter.config.block_size, drafter.config
    cost = StepCostModel(fixed=2e-3, per_token=4e-4)
    eng = SpecEngine(target, drafter, mode="adaflash", max_batch_size=6, max_seq_len=64, cost_model=cost,
                     calibrate=False, draft_off=False)
    hidden = torch.randn(6, block, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cap = torch.tensor([block, block, 3, block, 1, block])
    drafted = [i for i in range(6) if cap[i] > 1]
    spec = SpecBatch(torch.ones(6, dtype=torch.long), drafted=drafted)
    with torch.inference_mode():
        eng._verify_lengths(spec, hidden[drafted], cap)
    planner = lb.VerifyPlanner(drafter.length_head, block, rate=cfg.length_head_rate, min_len=cfg.length_head_min_len,
                               cost=cost)
    plan = planner.plan(hidden.reshape(6 * block, -1), 6, greedy=True, max_len=cap.tolist())
    assert plan.verify_lens_cpu == spec.lengths.tolist()
    # one step contract for both: the plugin's plan is the core's SpecMetadata, as the engine's is
    from sglang_adaflash.core.spec_metadata import SpecMetadata

    assert isinstance(plan, SpecMetadata) and isinstance(spec, SpecMetadata)
    assert torch.equal(plan.lengths, spec.lengths)
    assert len(set(plan.verify_lens_cpu)) > 2  # the rule made real choices here
    paper = lb.VerifyPlanner(drafter.length_head, block, rate=cfg.length_head_rate, min_len=cfg.length_head_min_len,
                             cost=cost, rule="paper")
    assert paper.plan(hidden.reshape(6 * block, -1), 6, greedy=True, max_len=cap.tolist()).verify_lens_cpu != plan.verify_lens_cpu
