"""Draft-off in mode d2sd: requests whose trees accept nothing are left out (verifying their
bonus token only, probed now and then), requests whose trees pay keep drafting, the output is
plain greedy decoding's token for token, and the drafters' contexts catch up after the steps a
request sat out."""

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.tree import Branch
from sglang_adaflash.engine import draft_choice
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.target.hf_target import TargetBatch

from ..engine.test_lossless_sampling import NEW
from .conftest import OracleD2SD, assert_follows_target, recovery_for, sampling_models
from .test_d2sd_engine import _mixed_run, _prompts, _run

# a drafter row costs about as much as 0.8 plain rows' tokens: drafting pays only when it accepts
DEAR_DRAFTS = StepCostModel(fixed=0.01, per_token=0.001, per_draft=0.004, draft_fixed=0.004)


# the recovery drafter's (per branch, fixed) seconds, set rather than profiled (about what the
# tiny pair's profile measures on an idle machine): a profile taken on a loaded one priced
# branches dearer, the plan built smaller trees, the oracle's short requests ran more steps,
# and whether their fifth step drafted came to depend on the machine's load (one CI run of
# test_trees_that_pay_keep_drafting failed so; at (2e-4, 1e-3) it fails every time)
RECOVERY_PRICE = (1e-5, 5e-4)


def _engine(cls, target, drafter, **kw):
    kw.setdefault("cost_model", DEAR_DRAFTS)
    kw.setdefault("max_batch_size", 3)
    eng = cls(target, drafter, recovery_for(drafter), tree_k=2, branch_len=3, max_seq_len=160, **kw)
    eng._tree_cost = RECOVERY_PRICE
    return eng


def _ar(target, prompts, max_new):
    return _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=160), prompts, max_new)


def _drafted_share(eng, outs):
    marks = [d for o in outs for d in o.stats.drafted]
    assert len(marks) == sum(o.stats.steps for o in outs)  # one mark per request-step
    return sum(marks) / len(marks)


def test_failing_trees_are_switched_off_losslessly(target, drafter):
    """A random drafter pair accepts about nothing: after the first reads a request is drafted
    on probes only, verifies its bonus token alone otherwise, and the output is ar's (requests
    join as others finish). Control: the same engine without draft-off drafts every step."""
    prompts = _prompts(5, seed=13)
    max_new = [40, 25, 33, 40, 12]
    ar = _ar(target, prompts, max_new)
    eng = _engine(D2SDEngine, target, drafter, draft_off=True, probe_every=4, probe_share=1.0)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new)])
    assert [o.output_ids for o in outs] == ar
    assert _drafted_share(eng, outs) < 0.4
    assert eng.tree_stats["plain_steps"] > 0.3 * eng.stats.steps, eng.tree_stats
    for o in outs:
        st = o.stats
        assert all(v == 1 for v, d in zip(st.verify_lens, st.drafted) if not d)
        if st.steps > 12:  # probed after 8 steps out (then 16: the gap doubles while probes fail)
            assert any(st.drafted[1:12]), "probes must keep drafting now and then"
    always = _engine(D2SDEngine, target, drafter)
    assert _run(always, prompts, max_new) == ar
    assert always.tree_stats["plain_steps"] == 0
    assert always.tree_stats["planned_steps"] >= 0.9 * always.stats.steps, always.tree_stats


def test_trees_that_pay_keep_drafting(target, drafter):
    """At the same prices an oracle pair (70% of its chain slots right, branches from the
    target's continuation) pays for its trees: every request drafts from its first step on and branches win (near a
    request's end, where few slots are left, it may stop).
    Were the trees' acceptance not what the choice reads, it would switch these off too."""
    prompts = _prompts(4, seed=5)
    max_new = [30, 18, 26, 30]
    eng = _engine(OracleD2SD, target, drafter, draft_off=True, probe_every=4, probe_share=1.0)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new)])
    assert [o.output_ids for o in outs] == _ar(target, prompts, max_new)
    assert all(all(o.stats.drafted[:5]) for o in outs), [o.stats.drafted for o in outs]
    assert _drafted_share(eng, outs) > 0.6
    assert eng.tree_stats["branch_wins"] > 3, eng.tree_stats
    assert eng.stats.committed_tokens / eng.stats.steps > 2


class _OneGoodOneBad(OracleD2SD):
    """The oracle, right 90% of the time for requests with a "good" id and 10% for the others,
    so in one batch some rows draft while others sit out."""

    def _chain_full_logits(self, seqs, rows):
        out = []
        for i in rows:
            self.error_rate = 0.1 if seqs[i].req.request_id.startswith("good") else 0.9
            out.append(super()._chain_full_logits(seqs, [i]))
        return torch.cat(out)


def _written_context_matches(eng, target, drafter) -> bool:
    """Every running request's drafter contexts (both drafters) equal a plain forward of its
    committed tokens at every position written so far (the backlog of `pending` tokens waits
    for the request's next draft)."""
    ok = True
    for slot, seq in enumerate(eng.running):
        written = 0 if seq.prompt_feats is not None else seq.cache_len - seq.pending  # a lazy prompt waits
        toks = (seq.req.prompt_ids + seq.output)[:written]
        target.capture_layer_ids = list(drafter.config.target_layer_ids)
        _, feats = target.forward(TargetBatch.from_lists([toks], [0]), target.new_cache(1, 160))
        pos = torch.arange(written)[None]
        for model, cache in ((drafter, eng.proposer.cache), (eng.recovery, eng.proposer.rcache)):
            with torch.inference_mode():
                kvs = model.context_kv(model.project_context(feats[None]), pos)
            for layer, (k, v) in enumerate(kvs):
                ok &= torch.allclose(cache.k[layer][slot, :, :written], k[0], rtol=1e-6, atol=1e-6)
                ok &= torch.allclose(cache.v[layer][slot, :, :written], v[0], rtol=1e-6, atol=1e-6)
    return ok


@pytest.mark.parametrize("source", ["recovery", "joint"])
@pytest.mark.parametrize("broken", [None, "forget", "not_queued", "wrong_position"])
def test_drafter_contexts_catch_up_after_sitting_out(target, drafter, broken, source, monkeypatch):
    """Good and bad requests in one batch (freed slots refilled): the bad ones sit out most
    steps, some of them tree steps of the good ones, and are probed now and then. After every
    step both drafters' context K/V equal a plain forward of the committed tokens at every
    position written, with the recovery drafter's kept lazily or (joint) written with the first
    drafter's by one stacked projection. Controls, each detected: a catch-up that drops the backlog, idle rows of a
    tree step not queued, and an idle queue that writes over the previous step's position."""
    if broken == "forget":
        def forget(self, seqs, rows, uncommitted=0):  # drops the prompt and the backlog unwritten
            for i in rows:
                seqs[i].pending, seqs[i].prompt_feats = 0, None

        monkeypatch.setattr(SpecEngine, "_catch_up", forget)
    if broken == "not_queued":
        extend = D2SDEngine._extend_contexts

        def drop_idle(self, seqs, drafted, feats, starts):
            queue, self._queue_idle = self._queue_idle, lambda *a: None
            try:
                extend(self, seqs, drafted, feats, starts)
            finally:
                self._queue_idle = queue

        monkeypatch.setattr(D2SDEngine, "_extend_contexts", drop_idle)
    if broken == "wrong_position":
        queue = SpecEngine._queue_idle

        def shifted(self, seqs, idle, rows, feats):
            self._ring -= 1  # the queue's ring then writes this step's features where the last step's are
            queue(self, seqs, idle, rows, feats)
            self._ring += 1

        monkeypatch.setattr(SpecEngine, "_queue_idle", shifted)
    prompts = _prompts(5, seed=11)
    eng = _OneGoodOneBad(target, drafter, recovery_for(drafter), tree_k=2, branch_len=3, max_batch_size=3,
                         max_seq_len=160, cost_model=DEAR_DRAFTS, draft_off=True, probe_every=3, probe_share=1.0,
                         branch_drafter=source)  # joint: both contexts from one stacked projection
    eng.proposer.FLUSH_AFTER = 1  # the recovery context filled whenever the first drafter's is
    max_new = [40, 30, 45, 20, 35]
    for k, (p, n) in enumerate(zip(prompts, max_new)):
        eng.submit(Request(p, SamplingParams(max_new_tokens=n), request_id=f"{'good' if k % 2 else 'bad'}-{k}"))
    ok, mixed, outs = True, 0, []
    while eng.has_unfinished():
        outs += eng.step()
        marks = [s.stats.drafted[-1] for s in eng.running if s.stats.drafted]
        mixed += any(marks) and not all(marks)
        ok &= _written_context_matches(eng, target, drafter)
    assert mixed > 10, mixed  # tree steps with rows sitting out
    assert all(o.ok for o in outs) and len(outs) == 5
    outs.sort(key=lambda o: int(o.request_id.split("-")[1]))
    assert [o.output_ids for o in outs] == _ar(target, prompts, max_new)
    bad = [d for o in outs if o.request_id.startswith("bad") for d in o.stats.drafted]
    assert 3 < sum(bad) < 0.5 * len(bad)  # sat out, then caught up on probes
    assert ok == (broken is None)


def test_a_full_backlog_is_written_where_it_belongs(target, drafter):
    """Without probes (probe_share 0) the bad requests sit out after their first read until
    their backlog fills (4 * probe_every + 1 steps) and is flushed in the middle of a step,
    before that step's commit: every position must still hold its own token's context. (It
    was written one position early, found in review.)"""
    prompts = _prompts(3, seed=12)
    eng = _OneGoodOneBad(target, drafter, recovery_for(drafter), tree_k=2, branch_len=3, max_batch_size=3,
                         max_seq_len=160, cost_model=DEAR_DRAFTS, draft_off=True, probe_every=2, probe_share=0.0)
    eng.proposer.FLUSH_AFTER = 1
    for k, p in enumerate(prompts):
        eng.submit(Request(p, SamplingParams(max_new_tokens=40), request_id=f"{'good' if k == 1 else 'bad'}-{k}"))
    ok, most = True, 0
    while eng.has_unfinished():
        eng.step()
        most = max([most] + [s.pending for s in eng.running])
        ok &= _written_context_matches(eng, target, drafter)
    assert most == eng.choice.max_pending - 1, (most, eng.choice.max_pending)  # full, then flushed
    assert ok


def test_draft_off_needs_the_load_aware_rule(target, drafter):
    with pytest.raises(ValueError, match="draft_off needs tree_rule 'load_aware'"):
        D2SDEngine(target, drafter, recovery_for(drafter), tree_rule="fixed", draft_off=True, max_seq_len=64)


def test_the_cli_flag_reaches_the_engine_and_is_refused_with_the_fixed_rule(target, drafter):
    import argparse
    from types import SimpleNamespace

    from sglang_adaflash.d2sd.cli import add_d2sd_args, make_d2sd_engine, options_from_args
    from sglang_adaflash.errors import CLIError

    p = argparse.ArgumentParser()
    add_d2sd_args(p)
    args = p.parse_args(["--recovery-drafter", "x", "--draft-off"])
    opts = options_from_args(args, ["d2sd"])
    assert opts.draft_off and opts.to_dict()["draft_off"]
    pair = SimpleNamespace(target=target, drafter=drafter, recovery=recovery_for(drafter), d2sd=opts)
    assert make_d2sd_engine(pair, 2, 64, 0)._draft_off
    assert not make_d2sd_engine(SimpleNamespace(**{**vars(pair), "d2sd": options_from_args(
        p.parse_args(["--recovery-drafter", "x"]), ["d2sd"])}), 2, 64, 0)._draft_off
    with pytest.raises(CLIError, match="--draft-off needs --tree-rule load_aware"):
        options_from_args(p.parse_args(["--recovery-drafter", "x", "--draft-off", "--tree-rule", "fixed"]), ["d2sd"])


@pytest.mark.parametrize("wrong", [False, True])
def test_every_position_follows_the_target_at_t_above_zero_with_draft_off(wrong, monkeypatch):
    """Sampled and greedy requests, plain steps and tree steps (first reads, probes, and rows
    whose trees pay) mixed: every committed position follows the target's distribution.
    Control: plain steps that do not tell the verifier which rows sample are rejected."""
    if wrong:
        monkeypatch.setattr(D2SDEngine, "_with_sampling", lambda self, spec, seqs: spec)
    # the full probe credit even where no row pays (draft_choice.could_pay): this test needs the mix
    monkeypatch.setattr(draft_choice, "LONG_SHOT_SHARE", 1.0)
    target, drafter, recovery = sampling_models()
    eng = D2SDEngine(target, drafter, recovery, tree_k=2, branch_len=2, draft_off=True, max_batch_size=8,
                     max_seq_len=32, seed=321, cost_model=DEAR_DRAFTS, probe_every=2, probe_share=1.0)
    eng._tree_cost = RECOVERY_PRICE  # set, not profiled: a loaded machine priced branches so dear that none won
    sp = SamplingParams(temperature=0.6, top_k=3, max_new_tokens=NEW)
    samples = _mixed_run(eng, sp)
    rows = sum(eng.stats.batch_sizes)
    assert 0.2 * rows < eng.tree_stats["idle_rows"] < 0.8 * rows, eng.tree_stats
    assert eng.tree_stats["plain_steps"] > 100, eng.tree_stats
    assert eng.tree_stats["branch_wins"] > 100, eng.tree_stats
    assert_follows_target(target, sp, samples, wrong)


def test_a_path_that_ran_to_a_leaf_counts_no_failure(target, drafter):
    """A tree whose chain (trimmed to 2 proposals) was accepted whole beside a deeper branch
    records 2 survivals and no failure; a path stopped before a child records one failure."""
    from sglang_adaflash.d2sd.tree import build_row
    from sglang_adaflash.d2sd.tree_verify import PathResult

    eng = D2SDEngine(target, drafter, recovery_for(drafter), draft_off=True, max_batch_size=2, max_seq_len=64)
    trees = [build_row(5, [7, 8], [Branch(2, [9, 10, 11])]), build_row(5, [7, 8], [])]
    results = [PathResult([0, 1, 2], [7, 8, 3]), PathResult([0, 1], [7, 4])]  # row 1 stopped before node 2
    eng._raw_conf = {}
    eng.posterior.reset(torch.tensor([0, 1]), [None, None])
    eng._observe_survival([0, 1], trees, results)
    s, f = eng.posterior.counts[:, 0].tolist(), eng.posterior.counts[:, 1].tolist()
    assert s == [2.0, 1.0] and f == [0.0, 1.0], (s, f)


def test_draft_off_with_the_measured_cost_model_is_lossless(target, drafter):
    """The other tests fix the step costs; here they are profiled and refitted from the steps'
    own timings (as bench and serve run), so forced rows are charged what they took
    (charge_forced). Which steps draft then depends on the machine; the output may not: it is
    ar's token for token, with requests joining as others finish, and an undrafted
    request-step verifies its bonus token only."""
    prompts = _prompts(5, seed=17)
    max_new = [30, 18, 26, 30, 9]
    eng = _engine(D2SDEngine, target, drafter, cost_model=None, draft_off=True, probe_every=3, probe_share=1.0)
    outs = eng.run([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new)])
    assert [o.output_ids for o in outs] == _ar(target, prompts, max_new)
    assert eng._online_cost is not None  # the measured model, not a fixed one
    for o in outs:
        assert len(o.stats.drafted) == o.stats.steps
        assert all(v == 1 for v, d in zip(o.stats.verify_lens, o.stats.drafted) if not d)


@pytest.mark.parametrize("draft_off", [True, False])
def test_rows_in_flight_at_a_swap_grow_no_tree(target, drafter, draft_off):
    """As in SpecEngine (tests/engine/test_adaptive.py): a row whose prompt the old drafter
    version projected grows no tree after drafter_swapped(), with or without draft-off, and the
    output is still ar's."""
    prompts = _prompts(2, seed=37)
    ar = _ar(target, prompts, [40, 40])
    eng = _engine(D2SDEngine, target, drafter, draft_off=draft_off, probe_every=2, probe_share=1.0)
    for p in prompts:
        eng.submit(Request(p, SamplingParams(max_new_tokens=40)))
    for _ in range(6):
        eng.step()
    assert all(seq.prompt_feats is None for seq in eng.running), "each row must have drafted once"
    eng.drafter_swapped()
    marks = {len(seq.stats.verify_lens) for seq in eng.running}
    assert len(marks) == 1  # both joined together: the same steps before the swap
    (mark,) = marks
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert sorted(o.output_ids for o in outs) == sorted(ar)
    for o in outs:
        after = o.stats.verify_lens[mark:]
        assert after and all(n == 1 for n in after), "a row in flight at the swap grew a tree"


def test_draft_off_trees_start_from_the_drafters_eval(target, drafter):
    """A D2SD engine with draft-off seeds its calibration from its drafter's manifest, as
    SpecEngine does (and as its inherited drafter_swapped does at a hot reload)."""
    drafter.manifest = {"eval": {"tau_by_domain": {"code": 3.0}}}
    try:
        eng = _engine(D2SDEngine, target, drafter, draft_off=True, tree_rule="load_aware")
    finally:
        drafter.manifest = None
    assert set(eng.posterior.prior) == {"code"}
    assert set(_engine(D2SDEngine, target, drafter, draft_off=True, tree_rule="load_aware").posterior.prior) == set()
