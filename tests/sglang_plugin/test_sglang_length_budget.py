"""Length head -> verify lengths -> ragged layout -> packed verify -> scatter-back -> capped
accept, on CPU tensors against SGLang's own torch references (and Triton kernels interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang.kernels.ops.speculative.dflash import (  # noqa: E402
    compute_dflash_correct_drafts_and_bonus,
)
from sglang.kernels.ops.speculative.dspark import dspark_verify_window as W  # noqa: E402
from sglang.kernels.ops.speculative.dspark.dspark_accept import cap_correct_len  # noqa: E402

from sglang_adaflash.drafter.length_head import AdaptiveLengthHead  # noqa: E402
from sglang_adaflash.engine.length_policy import StepCostModel  # noqa: E402
from sglang_adaflash.sglang_plugin import length_budget as lb  # noqa: E402

V = 97  # vocabulary of the fake target


def fake_target(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The token the 'target' predicts after token `id` at `position` (any fixed function)."""
    return (ids * 31 + positions * 7 + 3) % V


def make_block(prefix_lens, accept, block):
    """Blocks whose first accept_i proposals agree with the fake target, then disagree."""
    bs = len(prefix_lens)
    cand = torch.zeros(bs, block, dtype=torch.int64)
    for i in range(bs):
        cand[i, 0] = 11 + i
        for k in range(1, block):
            want = fake_target(cand[i, k - 1], torch.tensor(prefix_lens[i] + k - 1))
            cand[i, k] = want if k <= accept[i] else (want + 1) % V
    return cand


def reference_accept(cand, prefix_lens, verify_lens):
    """Slow, obvious rule: accept proposal k while k < L and it equals the target's token at
    slot k - 1; the bonus is the target's token at the first unaccepted slot."""
    acc, bonus = [], []
    for i, row in enumerate(cand.tolist()):
        a = 0
        for k in range(1, verify_lens[i]):
            pred = int(fake_target(torch.tensor(row[k - 1]), torch.tensor(prefix_lens[i] + k - 1)))
            if row[k] != pred:
                break
            a += 1
        acc.append(a)
        bonus.append(int(fake_target(torch.tensor(row[a]), torch.tensor(prefix_lens[i] + a))))
    return acc, bonus


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compact_verify_matches_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    block, bs = 8, 6
    prefix = torch.randint(5, 50, (bs,), generator=g)
    accept = torch.randint(0, block, (bs,), generator=g).tolist()
    verify_lens = torch.randint(1, block + 1, (bs,), generator=g).tolist()
    cand = make_block(prefix.tolist(), accept, block)
    plan = lb.VerifyPlan.from_lists(verify_lens, block)

    # The layout SGLang's verify forward receives, rounded up to a captured token bucket.
    runner = SimpleNamespace(
        decode_cuda_graph_runner=SimpleNamespace(
            ragged_verify_mode=True, capture_num_tokens=[block * n for n in (1, 2, 4, 8)], max_bs=8
        )
    )
    layout = lb.build_layout(plan, device=torch.device("cpu"), model_runner=runner)
    assert layout.total_verify_tokens == sum(verify_lens)
    assert layout.graph_num_tokens == min(t for t in (8, 16, 32, 64) if t >= sum(verify_lens))

    # Pack: SGLang's own packing of the anchor plus the first L_i - 1 proposals.
    ids = W.compact_verify_ids(
        draft_block_ids=cand, draft_tokens=cand[:, 1:], layout=layout, device="cpu"
    )
    req, within, valid = W.compact_row_index(
        verify_lens=layout.verify_lens, padded_total=layout.graph_num_tokens, device="cpu"
    )
    positions = prefix[req.clamp(max=bs - 1)] + within
    assert int(valid.sum()) == sum(verify_lens)  # the target computes only these rows

    # The target on packed rows only; logits as one-hot of its prediction.
    logits = torch.nn.functional.one_hot(fake_target(ids, positions), V).float()
    strided = lb.scatter_to_strided(logits, layout, block)  # [bs*B, V]
    assert strided.shape == (bs * block, V)
    predict = strided.argmax(-1).view(bs, block)

    capped = lb.cap_candidates(cand, torch.tensor(verify_lens))
    acc, bonus = compute_dflash_correct_drafts_and_bonus(candidates=capped, target_predict=predict)
    ref_acc, ref_bonus = reference_accept(cand, prefix.tolist(), verify_lens)
    assert acc.tolist() == ref_acc
    assert bonus.tolist() == ref_bonus
    # ... which is SGLang's own cap of the uncapped acceptance (CapCorrectLen's torch path).
    full_predict = fake_target(cand, prefix[:, None] + torch.arange(block))
    full_acc, _ = compute_dflash_correct_drafts_and_bonus(
        candidates=cand, target_predict=full_predict
    )
    sglang_capped, _ = cap_correct_len(correct_len=full_acc, verify_lens=torch.tensor(verify_lens))
    assert acc.tolist() == sglang_capped.tolist()


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
    from sglang_adaflash.engine.length_policy import choose_verify_lengths

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


_INTERPRETED = textwrap.dedent(
    """
    import torch, triton
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout
    from sglang.kernels.ops.speculative.dspark import dspark_verify_window as W
    from sglang.kernels.ops.speculative.dspark.dspark_accept import cap_correct_len, cap_correct_len_triton
    from sglang.kernels.ops.speculative.dflash import (
        compute_dflash_correct_drafts_and_bonus, _fused_correct_drafts_and_bonus_kernel)
    from sglang_adaflash.sglang_plugin import length_budget as lb

    g = torch.Generator().manual_seed(0)
    bs, B = 7, 8
    lens = torch.randint(1, B + 1, (bs,), generator=g).tolist()
    lay = RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=lens, device=torch.device("cpu"), grid=[64])
    comp = torch.randn(lay.graph_num_tokens, 5, generator=g)
    a = W.scatter_compact_to_strided(compact=comp, layout=lay, fill_value=0.0, verify_num_draft_tokens=B)
    b = W.scatter_compact_to_strided_triton(compact=comp, layout=lay, fill_value=0.0, verify_num_draft_tokens=B)
    assert torch.equal(a, b), "scatter"
    for x, y in zip(W.compact_row_index(verify_lens=lay.verify_lens, padded_total=64, device="cpu"),
                    W.compact_row_index_triton(verify_lens=lay.verify_lens, padded_total=64, device="cpu")):
        assert torch.equal(x, y), "row index"
    cand = torch.randint(0, 5, (bs, B), generator=g)
    pred = torch.randint(0, 5, (bs, B), generator=g)
    capped = lb.cap_candidates(cand, torch.tensor(lens))
    n = torch.empty(bs, dtype=torch.int32); bonus = torch.empty(bs, dtype=torch.int64)
    _fused_correct_drafts_and_bonus_kernel[(bs,)](capped, pred, n, bonus, B, BLOCK=triton.next_power_of_2(B - 1))
    ref_n, ref_bonus = compute_dflash_correct_drafts_and_bonus(candidates=capped, target_predict=pred)
    assert torch.equal(n, ref_n) and torch.equal(bonus, ref_bonus), "accept kernel"
    full_n, _ = compute_dflash_correct_drafts_and_bonus(candidates=cand, target_predict=pred)
    tri, _ = cap_correct_len_triton(correct_len=full_n, verify_lens=torch.tensor(lens, dtype=torch.int32))
    assert torch.equal(tri, n), "capping candidates == SGLang's CapCorrectLen"
    print("OK", lens, n.tolist())
    """
)


def test_triton_kernels_interpreted_agree():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
