"""A prefill that raises fails the request it is blamed on, and only that one (engine.admission).

Before, any exception in a step left the engine mid-step and stopped whoever drove it (the
server's loop, `adaflash generate`). The failure is injected where a request's own data is
used (its first token is sampled with its own parameters), for one marked prompt.
"""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.engine.admission import PROBE_ID, EngineFailure
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel

POISON = [13, 13, 13, 13, 13]
PROMPTS = {"a": [5, 6, 7], "b": [9, 1, 4, 4], "c": [3, 3, 3], "d": [8, 2], "e": [2, 4, 6, 8]}


def _engine(target, drafter, mode: str, max_batch_size: int = 3) -> SpecEngine:
    kw = dict(max_batch_size=max_batch_size, max_seq_len=60, seed=0)
    if mode == "d2sd":
        return D2SDEngine(target, drafter, None, branch_drafter="first", **kw)
    return SpecEngine(target, drafter if mode != "ar" else None, mode=mode, cost_model=StepCostModel(0.01, 0.001),
                      **kw)


def _poisoned(engine: SpecEngine, when=lambda seqs: any(s.req.prompt_ids == POISON for s in seqs),
              after_sampling: bool = False):
    """Make the engine's first-token sampling raise for any prefill that `when` says (before
    it samples, or after, when every row has drawn from its generator)."""
    real = engine._sample_rows
    calls = []

    def sample_rows(logits, seqs):
        calls.append([s.req.request_id for s in seqs])
        first = real(logits, seqs) if after_sampling else None
        if when(seqs):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, seqs) if first is None else first

    engine._sample_rows = sample_rows
    return calls


def _req(name: str, n: int = 12, **sampling) -> Request:
    prompt = POISON if name.startswith("poison") else PROMPTS[name]
    return Request(list(prompt), SamplingParams(max_new_tokens=n, **sampling), request_id=name)


@pytest.mark.parametrize("mode", ["ar", "dflash", "adaflash", "d2sd"])
def test_a_request_whose_prefill_raises_fails_alone(target, drafter, mode):
    clean = {o.request_id: o.output_ids for o in _engine(target, drafter, mode, 4).run(
        [_req(n) for n in "abcde"])}
    engine = _engine(target, drafter, mode, 4)
    calls = _poisoned(engine)
    # a and b run first; poison joins with c (a group prefill that fails), d and e wait for room
    for name in "ab":
        engine.submit(_req(name))
    engine.step()
    for name in ("poison", "c", "d", "e"):
        engine.submit(_req(name))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
        assert len(engine.running) <= engine.max_batch_size
    poison = outs.pop("poison")
    assert poison.finish_reason == "error" and poison.fault and poison.output_ids == []
    assert "RuntimeError: probability tensor contains" in poison.error and "not affected" in poison.error
    assert {k: o.output_ids for k, o in outs.items()} == clean  # everyone else: as if it never came
    assert all(o.ok and not o.fault for o in outs.values())
    assert ["poison", "c"] in calls and ["poison"] in calls and [PROBE_ID] in calls  # group, alone, probe
    assert engine.running == [] and not engine.waiting and engine.solo_admissions == 0


def test_a_seeded_request_in_the_failed_group_keeps_its_sample(target, drafter):
    """The failed group prefill drew from the seeded request's own generator; it is rewound."""
    sampled = dict(temperature=1.0, seed=11)
    alone = _engine(target, drafter, "dflash").run([_req("a", **sampled)])[0].output_ids
    engine = _engine(target, drafter, "dflash")
    _poisoned(engine, after_sampling=True)
    outs = {o.request_id: o for o in engine.run([_req("poison"), _req("a", **sampled)])}
    assert outs["poison"].fault and outs["a"].output_ids == alone


def test_the_freed_slot_serves_the_next_request(target, drafter):
    engine = _engine(target, drafter, "dflash", max_batch_size=1)
    _poisoned(engine)
    outs = {o.request_id: o for o in engine.run([_req("poison"), _req("a"), _req("poison2"), _req("b")])}
    assert [k for k, o in outs.items() if o.fault] == ["poison", "poison2"]
    assert all(len(outs[k].output_ids) == 12 for k in "ab")


def test_a_failure_the_probe_shares_is_the_engines_not_the_requests(target, drafter):
    """Every prefill raises (a broken device, say): blaming requests one by one would keep a
    server up while it answers nothing; the probe finds the engine itself failing."""
    engine = _engine(target, drafter, "dflash")
    _poisoned(engine, when=lambda seqs: True)
    for name in "ab":
        engine.submit(_req(name))
    with pytest.raises(EngineFailure, match="cannot prefill even a probe request"):
        for _ in range(4):
            engine.step()


def test_a_decode_step_that_raises_is_not_blamed_on_anyone(target, drafter, monkeypatch):
    engine = _engine(target, drafter, "dflash")
    engine.submit(_req("a"))
    engine.step()
    monkeypatch.setattr(engine, "_decode_step", lambda: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("boom")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.step()
