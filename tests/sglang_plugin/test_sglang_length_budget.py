"""Length head -> verify lengths -> ragged layout, on CPU tensors with SGLang's own layout helpers.

The packed verify, scatter-back and capped acceptance run inside SGLang's real decode step in
``test_sglang_cpu_engine.py`` (Triton kernels interpreted and torch references).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang_adaflash.drafter.length_head import AdaptiveLengthHead  # noqa: E402
from sglang_adaflash.planner.cost import StepCostModel  # noqa: E402
from sglang_adaflash.sglang_plugin import length_budget as lb  # noqa: E402


def test_batches_above_the_captured_graphs_run_on_exact_tokens():
    runner = SimpleNamespace(
        decode_cuda_graph_runner=SimpleNamespace(
            ragged_verify_mode=True, capture_num_tokens=[8, 16], max_bs=2
        )
    )
    plan = lb.VerifyPlan.from_lists([8, 8, 3], 8)  # 19 tokens > the largest bucket 16
    layout = lb.build_layout(plan, device=torch.device("cpu"), model_runner=runner)
    assert layout.graph_num_tokens == 19
    small = lb.build_layout(
        lb.VerifyPlan.from_lists([3, 2], 8), device=torch.device("cpu"), model_runner=runner
    )
    assert small.graph_num_tokens == 8
    eager = SimpleNamespace(decode_cuda_graph_runner=None)  # graphs disabled
    assert (
        lb.build_layout(plan, device=torch.device("cpu"), model_runner=eager).graph_num_tokens == 19
    )


def test_uniform_plan_packs_whole_blocks():
    plan = lb.VerifyPlan.uniform(3, 4, "sampling")
    assert plan.is_uniform and plan.num_verify_tokens == 12
    layout = lb.build_layout(plan, device=torch.device("cpu"))
    assert layout.graph_num_tokens == 12
    cand = torch.arange(12).view(3, 4)
    assert torch.equal(lb.cap_candidates(cand, torch.tensor(plan.verify_lens_cpu)), cand)


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
