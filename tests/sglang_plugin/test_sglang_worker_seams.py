"""The worker's seams into SGLang's DFlashWorkerV2, on CPU with fakes around the real methods.

SGLang's worker cannot be built without CUDA, so these tests create the object without
running ``__init__`` and give it only what each seam reads. What they prove: the length plan
reaches the verify call, the verify call is rebuilt compact and scattered back, acceptance is
capped through SGLang's own ``_accept_block``, batch state is restored, and the per-step
metrics are matched with SGLang's host-side accept counts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang.kernels.ops.speculative.dspark import dspark_verify_window as W  # noqa: E402
from sglang.srt.speculative.dflash_info import DFlashVerifyInput  # noqa: E402
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2  # noqa: E402

from sglang_adaflash.serving.metrics import NullSink  # noqa: E402
from sglang_adaflash.sglang_plugin import length_budget as lb  # noqa: E402
from sglang_adaflash.sglang_plugin import worker as wmod  # noqa: E402
from sglang_adaflash.sglang_plugin.runtime import StepStatsQueue  # noqa: E402

B, V = 4, 50


class FakePlanner:
    min_len = 1

    def __init__(self, lens):
        self.lens = lens
        self.head = object()
        self.seen = []

    def plan(self, hidden, bs, *, greedy, max_len=None, budget=None):
        self.seen.append((None if hidden is None else tuple(hidden.shape), bs, greedy, max_len))
        self.budget = budget
        return lb.VerifyPlan.from_lists(self.lens, B)


class RecSink(NullSink):
    def __init__(self):
        self.steps = []

    def observe_step(self, stats):
        self.steps.append(stats)


class FakeReloader:
    def __init__(self):
        self.calls = 0
        self.status = SimpleNamespace(loaded_version="v000001")

    def at_step_boundary(self):
        self.calls += 1


def make_worker(mode="compact", lens=(4, 2, 1)):
    w = object.__new__(wmod.AdaFlashWorkerV2)
    w.block_size = B
    w.device = torch.device("cpu")
    w._ada_mode = mode
    w._ada_step = None
    w._ada_planner = FakePlanner(list(lens))
    w._ada_tp_group = SimpleNamespace(world_size=1)
    w._ada_tp_rank = 0
    w._ada_sink = RecSink()
    w._ada_stats = StepStatsQueue(w._ada_sink)
    w._ada_reloader = FakeReloader()
    w._ada_lag = lb.LaggedMean(B)
    w._ada_uniform_layouts = {}
    w._target_worker = FakeTarget()
    w.draft_model_runner = FakeDraftRunner()
    # read by DFlashWorkerV2._accept_block (greedy torch path)
    w._selector_sample = None
    w._use_triton_accept_bonus = False
    w._tp_sync = SimpleNamespace(sync=lambda *args: None)
    return w


def target_fn(ids, positions):
    return (ids * 3 + positions + 1) % V


class FakeTarget:
    """A target worker whose verify returns one-hot logits of target_fn on the rows it gets."""

    def __init__(self):
        self.model_runner = SimpleNamespace(decode_cuda_graph_runner=None, ragged=True)
        self.verify_calls = []

    def forward_batch_generation(self, batch=None, forward_batch=None, is_verify=False, **kw):
        self.verify_calls.append((forward_batch, kw))
        ids, pos = forward_batch.input_ids, forward_batch.positions
        logits = torch.nn.functional.one_hot(target_fn(ids, pos), V).float()
        hidden = torch.stack([ids.float(), pos.float()], dim=-1)  # [T, 2]
        return SimpleNamespace(
            logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
            can_run_cuda_graph=False,
        )


class FakeDraftRunner:
    def forward(self, forward_batch):
        bs = forward_batch
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=torch.zeros(bs * B, 8)))


def fake_window(
    *,
    batch,
    layout,
    draft_block_ids,
    draft_tokens,
    bs,
    device,
    verify_num_draft_tokens,
    model_runner,
):
    """SGLang's packing of ids and positions (its torch pieces); cache slots are fake."""
    ids = W.compact_verify_ids(
        draft_block_ids=draft_block_ids, draft_tokens=draft_tokens, layout=layout, device=device
    )
    req, within, valid = W.compact_row_index(
        verify_lens=layout.verify_lens, padded_total=layout.graph_num_tokens, device=device
    )
    positions = torch.where(valid, batch.seq_lens[req.clamp(max=bs - 1)] + within, 0)
    return W.RaggedVerifyWindow(
        positions=positions,
        verify_cache_loc=torch.where(valid, 1000 + positions, 0),
        verify_ids=ids,
        window_index=torch.where(
            valid, req.clamp(max=bs - 1) * verify_num_draft_tokens + within, -1
        ),
    )


def fake_prepare(self, batch, target_worker, *, defer_metadata_init=False):
    """Stands in for DFlashVerifyInput.prepare_for_verify: records what it was given."""
    fb = SimpleNamespace(
        input_ids=self.draft_token,
        positions=self.positions,
        spec_info=self,
        out_cache_loc=batch.out_cache_loc,
        seq_lens_cpu=None if batch.seq_lens_cpu is None else batch.seq_lens_cpu.clone(),
    )
    batch.input_ids, batch.spec_info = self.draft_token, self
    return fb, False


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(W.BuildRaggedVerifyWindow, "execute", staticmethod(fake_window))
    monkeypatch.setattr(DFlashVerifyInput, "prepare_for_verify", fake_prepare)


def fake_dflash_step(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
    """The order of SGLang's decode step, reduced to the calls our seams join."""
    bs = len(batch.seq_lens)
    self.draft_model_runner.forward(bs)  # 1) draft
    cand = batch.cand
    positions = batch.seq_lens[:, None] + torch.arange(B)
    full_input = DFlashVerifyInput(
        draft_token=cand.reshape(-1), positions=positions.reshape(-1), draft_token_num=B
    )
    full_fb = SimpleNamespace(
        spec_info=full_input, input_ids=cand.reshape(-1), positions=positions.reshape(-1)
    )
    out = self.target_worker.forward_batch_generation(  # 2) verify
        batch=None, forward_batch=full_fb, is_verify=True, skip_attn_backend_init=True
    )
    accept, commit, bonus, tokens, _ = self._accept_block(  # 3) accept
        candidates=cand,
        next_token_logits=out.logits_output.next_token_logits,
        sampling_info=None,
        draft_input=None,
        prefix_lens=batch.seq_lens,
        bs=bs,
    )
    return SimpleNamespace(
        accept_lens=commit,
        next_token_ids=tokens,
        bonus=bonus,
        cap_lens=None,
        hidden=out.logits_output.hidden_states,
    )


def make_batch(lens_accept=(3, 3, 3)):
    seq_lens = torch.tensor([10, 20, 30])
    cand = torch.zeros(3, B, dtype=torch.int64)
    for i in range(3):
        cand[i, 0] = 7 + i
        for k in range(1, B):
            want = target_fn(cand[i, k - 1], seq_lens[i] + k - 1)
            cand[i, k] = want if k <= lens_accept[i] else (want + 1) % V
    return SimpleNamespace(
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=60,
        out_cache_loc=torch.arange(12),
        input_ids=None,
        spec_info=None,
        cand=cand,
        reqs=[
            SimpleNamespace(
                sampling_params=SimpleNamespace(custom_params={"domain": "code"}, max_new_tokens=m),
                output_ids=[0] * 3,
            )
            for m in (8, 6, 6)
        ],
        sampling_info=None,
        has_grammar=False,
        return_logprob=False,
        forward_mode=SimpleNamespace(is_idle=lambda: False, is_extend=lambda: False),
        is_extend_in_batch=False,
    )


def test_decode_step_runs_compact_and_caps(monkeypatch, patched):
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", fake_dflash_step)
    w = make_worker("compact", lens=(4, 2, 1))
    real_runner = w.draft_model_runner
    batch = make_batch()
    result = w.forward_batch_generation(batch)

    assert w._ada_reloader.calls == 1  # reload point before the step
    # the head saw the draft states; lengths are capped by the tokens each request may still make
    assert w._ada_planner.seen == [((3 * B, 8), 3, True, [5, 3, 3])]
    # the host's total, decided before drafting: caps [4, 3, 3], no lag yet (whole blocks)
    assert w._ada_planner.budget.cap == [4, 3, 3] and w._ada_planner.budget.total == 10
    assert w.draft_model_runner is real_runner and w._ada_step is None  # seams removed
    ((fb, kw),) = w._target_worker.verify_calls
    assert kw["skip_attn_backend_init"] is True
    layout = fb.spec_info.ragged_verify_layout
    assert layout.total_verify_tokens == 7  # 4 + 2 + 1 packed rows, not 3 * 4
    assert fb.input_ids.numel() == layout.graph_num_tokens == 10  # padded to the host's bucket
    assert layout.verify_lens.tolist() == [4, 2, 1]
    assert fb.seq_lens_cpu.tolist() == [14, 23, 33]  # committed + the most it may verify
    # batch state the rest of SGLang's step reads is restored
    assert batch.out_cache_loc.tolist() == list(range(12)) and batch.seq_lens_cpu.tolist() == [
        10,
        20,
        30,
    ]
    assert batch.seq_lens_sum == 60
    assert w._ada_lag.read() == 4.0  # the fake plan has no rule lengths: nothing to lag
    # capped acceptance: min(3, L - 1); bonus from the verified slot; no marker leaks out
    assert (result.accept_lens - 1).tolist() == [3, 1, 0]
    want_bonus = [
        int(target_fn(batch.cand[i, a], batch.seq_lens[i] + a)) for i, a in enumerate([3, 1, 0])
    ]
    assert result.bonus.tolist() == want_bonus
    assert int(result.next_token_ids.min()) >= 0
    # hidden states scattered back to [bs * B]: verified slots carry their (id, position)
    hidden = result.hidden.view(3, B, 2)
    assert hidden[1, 1].tolist() == [float(batch.cand[1, 1]), 21.0]
    assert hidden[1, 2].tolist() == [0.0, 0.0]  # not verified
    assert result.cap_lens.tolist() == [4, 2, 1]  # feeds sglang:spec_cap_length

    w.on_verify_complete_cpu([3, 1, 0], batch_size=3)
    (stats,) = w._ada_sink.steps
    assert stats.candidate_lengths == [4, 2, 1] and stats.accept_lengths == [3, 1, 0]
    assert stats.domains == ["code"] * 3


def test_cap_mode_verifies_whole_blocks_but_caps(monkeypatch, patched):
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", fake_dflash_step)
    w = make_worker("cap", lens=(2, 2, 2))
    result = w.forward_batch_generation(make_batch())
    ((fb, _),) = w._target_worker.verify_calls
    assert fb.input_ids.numel() == 3 * B  # the full block went to the target
    assert (result.accept_lens - 1).tolist() == [1, 1, 1]


def test_fixed_mode_leaves_dflash_alone(monkeypatch, patched):
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", fake_dflash_step)
    w = make_worker("fixed")
    result = w.forward_batch_generation(make_batch())
    assert w._ada_planner.seen == []
    assert (result.accept_lens - 1).tolist() == [3, 3, 3]
    w.on_verify_complete_cpu([3, 3, 3], batch_size=3)
    assert w._ada_sink.steps[0].candidate_lengths == [B] * 3


def test_sampled_batch_verifies_whole_blocks(monkeypatch, patched):
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", fake_dflash_step)
    w = make_worker("compact", lens=(1, 1, 1))
    w._ada_planner = lb.VerifyPlanner(None, B, rate=1.3, min_len=1, cost=None, rule="paper")
    batch = make_batch()
    batch.sampling_info = SimpleNamespace(is_all_greedy=False)
    w.forward_batch_generation(batch)
    ((fb, _),) = w._target_worker.verify_calls
    assert fb.input_ids.numel() == 3 * B


def test_target_worker_property_only_proxies_inside_a_compact_step():
    w = make_worker("compact")
    assert w.target_worker is w._target_worker
    w._ada_step = wmod._Step(make_batch(), True, None)
    assert isinstance(w.target_worker, wmod.CompactVerifyTarget)
    # DFlash's full-width verify preparation sees no graph and plans no attention metadata
    runner = w.target_worker.model_runner
    assert runner.decode_cuda_graph_runner is None
    w._target_worker.model_runner.attn_backend = SimpleNamespace(
        init_forward_metadata=lambda fb: pytest.fail("planned the full-width verify"), name="fa3"
    )
    runner.attn_backend.init_forward_metadata(object())
    assert runner.attn_backend.name == "fa3" and runner.ragged is True  # forwards the rest
    w._ada_mode = "cap"
    assert w.target_worker is w._target_worker
    fresh = object.__new__(wmod.AdaFlashWorkerV2)
    fresh._target_worker = "t"
    assert fresh.target_worker == "t"  # before our __init__ ran


def test_request_domains():
    batch = SimpleNamespace(
        reqs=[
            SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"domain": "math"})),
            SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None)),
        ]
    )
    assert wmod._request_domains(batch) == ["math", None]
    batch.reqs = batch.reqs[1:]
    assert wmod._request_domains(batch) is None


def test_remaining_tokens():
    def req(limit, produced):
        return SimpleNamespace(
            sampling_params=SimpleNamespace(max_new_tokens=limit), output_ids=[0] * produced
        )

    assert wmod._remaining_tokens(SimpleNamespace(reqs=[req(10, 4), req(5, 5)])) == [6, 1]
    assert wmod._remaining_tokens(SimpleNamespace(reqs=[req(None, 1)])) is None


def test_calls_before_our_init_go_straight_to_dflash(monkeypatch):
    calls = []
    monkeypatch.setattr(
        DFlashWorkerV2, "forward_batch_generation", lambda self, batch, **kw: calls.append(batch)
    )
    monkeypatch.setattr(DFlashWorkerV2, "_accept_block", lambda self, **kw: kw["candidates"])
    monkeypatch.setattr(DFlashWorkerV2, "on_verify_complete_cpu", lambda self, *a, **k: None)
    w = object.__new__(wmod.AdaFlashWorkerV2)
    w._target_worker = FakeTarget()
    w.forward_batch_generation("warmup-batch")
    assert calls == ["warmup-batch"]
    cand = torch.ones(2, B, dtype=torch.int64)
    assert w._accept_block(candidates=cand) is cand
    w.on_verify_complete_cpu([1, 2], batch_size=2)  # no stats queue yet: ignored


@pytest.mark.parametrize("needs_logits", [False, True])
def test_only_steps_that_need_logits_get_strided_logits(monkeypatch, patched, needs_logits):
    """A greedy compact step hands SGLang's acceptance the target's tokens and a stand-in
    with no memory of its own for the [bs*B, V] logits; a step that needs the logits
    themselves (here: logprobs) gets them scattered back, and SGLang takes the argmax."""
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", fake_dflash_step)
    seen = {}
    accept = DFlashWorkerV2._accept_block

    def spy(self, **kwargs):
        seen.update(kwargs)
        return accept(self, **kwargs)

    monkeypatch.setattr(DFlashWorkerV2, "_accept_block", spy)
    w = make_worker("compact", lens=(4, 2, 1))
    batch = make_batch()
    batch.return_logprob = needs_logits
    result = w.forward_batch_generation(batch)
    logits = seen["next_token_logits"]
    assert logits.shape == (3 * B, V)
    if needs_logits:
        assert seen.get("target_predict") is None and logits.stride(0) == V
        assert logits.view(3, B, V)[1, 2].abs().sum() == 0  # an unverified slot
    else:
        assert logits.stride(0) == 0 and logits.untyped_storage().nbytes() == 4
        predict = seen["target_predict"].view(3, B)
        assert predict[0].tolist() == [
            int(target_fn(batch.cand[0, k], batch.seq_lens[0] + k)) for k in range(B)
        ]
    assert (result.accept_lens - 1).tolist() == [3, 1, 0]
