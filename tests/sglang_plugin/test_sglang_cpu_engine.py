"""ADAFLASH inside SGLang's own scheduler on CPU: the embedded pair, real requests, real steps.

``cpu_sglang`` builds SGLang 0.5.23's Scheduler in a fresh process, exactly as a scheduler
process does, with only CUDA-only pieces swapped at their lowest seam (its docstring lists
them), and serves greedy and sampled requests through the plugin's decode step. It runs once
with SGLang's CPU dispatch (its torch reference implementations) and once with every ragged
verify, scatter, accept and block-preparation kernel dispatched to SGLang's Triton kernels
under ``TRITON_INTERPRET=1``. What each step's verification saw and decided is compared between
the two runs, with the packing SGLang's layout implies, and with the reference engine's
verifier (``sglang_adaflash.core.rejection``) on the same logits.
"""

from __future__ import annotations

import pytest
import torch

# Three SGLang start-ups on shared cores can outlast the suite-wide 300 s test timeout.
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]
pytest.importorskip("sglang")

from sglang_adaflash.core.rejection import verify_greedy, verify_sampling  # noqa: E402
from sglang_adaflash.core.sampling import filtered_probs  # noqa: E402
from tests.sglang_plugin.harness_runs import run_harness  # noqa: E402

B = 16  # the embedded drafter's block size

#: The SGLang Triton kernels a compact decode step must launch, and the plugin function that
#: leads to each (the innermost plugin frame on the stack at launch).
EXPECTED_KERNELS = {
    "sglang.kernels.ops.speculative.dspark.dspark_verify_window._compact_row_index_kernel":
        "compact_verify.CompactVerify._compact_verify",
    "sglang.kernels.ops.speculative.dspark.dspark_verify_window._ragged_finalize_kernel":
        "compact_verify.CompactVerify._compact_verify",
    "sglang.kernels.ops.speculative.dspark.dspark_verify_window._compact_verify_ids_gather_kernel":
        "compact_verify.CompactVerify._compact_verify",
    "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs":
        "compact_verify.CompactVerify._compact_verify",
    "sglang.kernels.ops.speculative.dspark.dspark_verify_window._scatter_compact_to_strided_kernel":
        "length_budget.scatter_to_strided",
    "sglang.kernels.ops.speculative.dflash._dflash_accept_bonus_contig_kernel":
        "worker.AdaFlashWorkerV2._accept_block",
    "sglang.kernels.ops.speculative.dflash._prepare_dflash_draft_block_contig_kernel":
        "worker.AdaFlashWorkerV2.forward_batch_generation",
}  # fmt: skip

#: (mode, dispatch) -> extra harness arguments. The compact runs use SGLang's overlap scheduler
#: and radix cache (the harness's default); the cap run keeps the synchronous scheduler and no
#: prefix cache, so both of SGLang's event loops are exercised.
RUNS = {
    ("compact", "torch"): [],
    ("compact", "triton"): [],
    ("cap", "torch"): ["--no-overlap", "--no-radix"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], tuple[dict, list[dict]]]:
    """The harness once per (mode, dispatch), the three processes side by side."""
    return run_harness(
        {(m, d): ["--mode", m, "--dispatch", d, *extra] for (m, d), extra in RUNS.items()},
        tmp_path_factory,
        timeout=1800,
    )


def _run(runs, mode, dispatch):
    summary, steps = runs[mode, dispatch]
    assert not summary.get("error"), summary["error"]
    return summary, steps


@pytest.fixture(scope="module")
def compact_torch(runs):
    return _run(runs, "compact", "torch")


@pytest.fixture(scope="module")
def compact_triton(runs):
    return _run(runs, "compact", "triton")


@pytest.fixture(scope="module")
def cap_torch(runs):
    return _run(runs, "cap", "torch")


@pytest.fixture(params=["torch", "triton"])
def compact(request, compact_torch, compact_triton):
    return compact_torch if request.param == "torch" else compact_triton


# -- construction ------------------------------------------------------------------------------


def test_worker_builds_in_sglangs_scheduler_order(compact_torch):
    """SGLang builds the speculative worker before any attention backend exists; a worker that
    reads one in __init__ dies at start-up (AttributeError on ModelRunner.attn_backend)."""
    summary, _ = compact_torch
    order = summary["order"]
    assert order.index("AdaFlashWorkerV2.__init__ ends") < order.index("target backends"), order
    assert summary["worker"] == {
        "class": "AdaFlashWorkerV2",
        "mode": "compact",
        "head": True,
        "target_backend": "CpuRaggedVerifyBackend",
        "draft_backend": "CpuRaggedVerifyBackend",
    }


def test_overlap_scheduler_and_radix_cache_serve_compact_steps(compact, cap_torch):
    """The compact runs go through SGLang's overlap event loop (a batch is launched before the
    previous batch's result is processed) with the radix cache on: a request whose prompt was
    served before reuses its cached prefix, and its greedy output is the same as the first
    time. The cap run is the synchronous, cache-less control."""
    summary, steps = compact
    sched = summary["scheduler"]
    assert sched["overlap"] and sched["radix"]
    assert sched["cached_tokens"]["m0"] > 0  # m0 repeats g2's prompt
    again, first = summary["outputs"]["m0"], summary["outputs"]["g2"]
    n = min(len(again), len(first))
    assert n >= 10 and again[:n] == first[:n]
    assert any(s["phase"] == "mixed" for s in steps)
    control = cap_torch[0]["scheduler"]
    assert not control["overlap"] and not control["radix"]
    assert set(control["cached_tokens"].values()) == {0}


def test_cap_mode_builds_and_caps_whole_block_verification(cap_torch):
    summary, steps = cap_torch
    assert summary["worker"]["mode"] == "cap"
    greedy = [s for s in steps if s["phase"] == "greedy"]
    assert any(min(s["verify_lens"]) < B for s in greedy)
    for s in greedy:
        assert (
            not s["verify"]["ragged"]
            and s["verify"]["input_ids"].numel() == len(s["verify_lens"]) * B
        )
        assert all(int(a) <= n - 1 for a, n in zip(s["accept_len"], s["verify_lens"]))
    check_against_reference_engine(steps)


# -- the compact step through the plugin's own code path --------------------------------------


def test_interpreted_triton_and_torch_paths_agree(compact_torch, compact_triton):
    """The same requests through SGLang's Triton kernels (interpreted) and its torch references
    give the same verify inputs, logits, acceptances and outputs, step by step. A wrong
    anchor in the Triton packing (the block ids must be gamma = B - 1 wide) breaks this."""
    (a_sum, a_steps), (b_sum, b_steps) = compact_torch, compact_triton
    assert len(a_steps) == len(b_steps) > 0
    for i, (a, b) in enumerate(zip(a_steps, b_steps)):
        assert a["verify_lens"] == b["verify_lens"], i
        for key in ("candidates", "logits", "accept_len", "commit_lens", "bonus", "out_tokens"):
            assert torch.equal(a[key], b[key]), (i, key)
        for key in ("input_ids", "positions", "out_cache_loc"):
            assert torch.equal(a["verify"][key], b["verify"][key]), (i, key)
    assert a_sum["outputs"] == b_sum["outputs"]


def test_compact_verify_packs_each_requests_anchor_and_proposals(compact):
    """Row j of request i in the packed verify is block slot j: the anchor (the last committed
    token) at position prefix_i, then the proposals, written to the request's own KV slots."""
    _, steps = compact
    ragged_seen = 0
    for s in steps:
        v = s["verify"]
        assert v["ragged"]
        lens, cand, prefix = s["verify_lens"], s["candidates"], s["prefix_lens"]
        ids, pos, loc = [], [], []
        for i, n in enumerate(lens):
            ids.append(cand[i, :n])
            pos.append(prefix[i] + torch.arange(n))
            loc.append(v["req_to_token"][i, prefix[i] : prefix[i] + n])
        total = sum(lens)
        assert torch.equal(v["input_ids"][:total], torch.cat(ids))
        assert torch.equal(v["positions"][:total], torch.cat(pos).to(v["positions"].dtype))
        assert torch.equal(v["out_cache_loc"][:total].long(), torch.cat(loc).long())
        ragged_seen += len(set(lens)) > 1 and len(lens) >= 3
    assert ragged_seen, "no step verified ragged lengths at batch >= 3"


def check_against_reference_engine(steps):
    """SGLang's acceptance in each step equals the reference engine's verifier on the logits
    the plugin handed to SGLang: greedy rows by verify_greedy, sampled rows by verify_sampling
    with the drafter's (greedy) proposal as q."""
    g = torch.Generator().manual_seed(0)
    kinds = set()
    for s in steps:
        bs = len(s["verify_lens"])
        logits = s["logits"].view(bs, B, -1)
        for i in range(bs):
            n = s["verify_lens"][i]
            draft = s["candidates"][i : i + 1, 1:]
            greedy = int(s["top_ks"][i]) == 1
            if greedy:
                ref = verify_greedy(draft, logits[i : i + 1], torch.tensor([n - 1]))
            else:
                probs = filtered_probs(
                    logits[i], s["temperatures"][i].expand(B), s["top_ks"][i].expand(B),
                    s["top_ps"][i].expand(B),
                )  # fmt: skip
                q = torch.nn.functional.one_hot(draft[0], probs.shape[-1]).float()[None]
                ref = verify_sampling(draft, q, probs[None], torch.tensor([n - 1]), generator=g)
            kinds.add((greedy, bs >= 3))
            ours = s["out_tokens"][i, : int(s["commit_lens"][i])].tolist()
            theirs = ref.to_lists()[0]
            if not greedy and ours != theirs:
                # Both are right when the target's distribution ties exactly at the first slot
                # where they differ (bf16 logits do tie): nothing decides between the two.
                d = next(j for j, (x, y) in enumerate(zip(ours, theirs)) if x != y)
                p = probs[d]
                assert p[ours[d]] == p[theirs[d]] == p.max(), (s["phase"], i, ours, theirs)
                continue
            assert ours == theirs, (s["phase"], i, ours, theirs)
            assert int(s["accept_len"][i]) == len(theirs) - 1
            assert int(s["bonus"][i]) == theirs[-1]
    return kinds


def test_acceptance_matches_the_reference_engine(compact):
    _, steps = compact
    kinds = check_against_reference_engine(steps)
    # greedy and sampled rows were both verified, each in a batch of at least three
    assert {(True, True), (False, True)} <= kinds
    assert any(s["phase"] == "mixed" and len(set(s["top_ks"].tolist())) > 1 for s in steps)


def test_sglang_kernels_run_interpreted_through_plugin_functions(compact_triton):
    summary, _ = compact_triton
    launched = summary["kernels"]
    for kernel, caller in EXPECTED_KERNELS.items():
        assert caller in launched.get(kernel, []), (kernel, launched.get(kernel))


def test_compact_steps_read_nothing_back_from_the_device(compact_torch):
    """Between the drafter's output and the verify logits the plugin never waits for the
    device: lengths are planned, fitted to the host's lagged total, packed and scattered on
    the device (cpu_sglang.SyncTrap lists what is trapped). Fails on a plugin that copies the
    plan to the host (``tolist``) and back (``torch.tensor(..., device=...)``)."""
    summary, steps = compact_torch
    trap = summary["sync_trap"]
    assert trap["windows"] >= len([s for s in steps if s["phase"] == "greedy"]) > 0
    assert trap["violations"] == [], trap["violations"]


def test_compact_steps_prepare_only_the_compact_verify(compact_torch):
    """The full-width verify that DFlash prepares is never run in compact mode, so its attention
    metadata is not planned: per step the target plans the compact batch, which the eager
    forward plans again (as SGLang's eager verify always does), and nothing else."""
    summary, steps = compact_torch
    calls = [c for c in summary["metadata_calls"] if c[0] == "target" and c[1] == "TARGET_VERIFY"]
    greedy = [s for s in steps if s["phase"] == "greedy"]
    assert [tuple(c[2:]) for c in calls] == [
        (len(s["verify_lens"]), sum(s["verify_lens"])) for s in greedy for _ in range(2)
    ]


def test_greedy_compact_steps_keep_no_strided_logits(compact):
    """A greedy compact step hands DFlash's acceptance the target's tokens, scattered to the
    strided layout, and a [bs*B, V] stand-in with no memory of its own: no [bs*B, V] float32
    logits buffer exists in the greedy phase (the plugin allocates one only for steps that
    need logits: logprobs, grammar, penalties). The tokens are the argmax of the verified
    rows, and on the Triton path they land in one reused buffer. Fails on a plugin that
    scatters the logits back for every compact step."""
    _, steps = compact
    greedy = [s for s in steps if s["phase"] == "greedy"]
    assert greedy
    for s in greedy:
        assert s["logits_stand_in"] and "logits" not in s["buffers"]
        bs = len(s["verify_lens"])
        predict = s["predict"].view(bs, B)
        top1 = s["logits"].view(bs, B, -1).argmax(-1)
        for i, n in enumerate(s["verify_lens"]):
            assert torch.equal(predict[i, :n], top1[i, :n])
    # SGLang's Triton scatter writes into the plugin's buffer (its torch path allocates): a
    # new buffer only when the batch outgrows every earlier one
    ptr, widest = None, 0
    for s in greedy:
        bs = len(s["verify_lens"])
        if s["buffers"].get("predict") != ptr:
            assert bs > widest, "the token buffer was reallocated for a batch that fitted"
            ptr = s["buffers"].get("predict")
        widest = max(widest, bs)


def test_sampled_batches_cost_what_dflash_costs(compact):
    """A batch with a sampled request verifies whole blocks through DFlash's own verify batch
    (with the uniform layout attached): one verify batch of bs * B tokens with its metadata
    planned as DFLASH's eager verify plans it (its preparation, then the eager forward), no
    packed window and no [bs*B, V] scatter. Fails when such a step still builds the compact
    batch: the plugin's packed verify path runs (and on the Triton path its logits land in
    the scatter buffer)."""
    summary, steps = compact
    mixed = [s for s in steps if s["phase"] == "mixed"]
    assert mixed
    assert summary["compact_verifies"].get("mixed", 0) == 0  # greedy phase: it does run
    assert summary["compact_verifies"]["greedy"] > 0
    for s in mixed:
        bs = len(s["verify_lens"])
        assert s["verify_lens"] == [B] * bs
        assert s["verify"]["ragged"] and s["verify"]["input_ids"].numel() == bs * B
        assert s["logits_ptr"] != s["buffers"].get("logits")
    calls = [c for c in summary["metadata_calls_mixed"] if c[0] == "target" and c[1] == "TARGET_VERIFY"]
    want = [(len(s["verify_lens"]), len(s["verify_lens"]) * B) for s in mixed for _ in range(2)]
    assert [tuple(c[2:]) for c in calls] == want


def test_reload_under_load_swaps_in_place_through_sglangs_draft_model(compact):
    """A new version staged while requests run is copied into SGLang's DFlash draft model
    between two steps: same storage, new values, and the fused draft-KV helper's weight stacks
    refreshed in place to what a freshly built helper holds."""
    summary, _ = compact
    r = summary["reload"]
    assert r["staged"] == r["version"] == r["loaded"] == "v000002"
    assert r["in_place"] and r["last_error"] is None
    assert "layers.0.self_attn.qkv_proj.weight" in r["changed"] and "fc.weight" in r["changed"]
    assert r["helper_in_place"] and r["helper_matches_fresh"]
