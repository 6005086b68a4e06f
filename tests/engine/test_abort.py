"""SpecEngine.abort: a dropped request frees its slot and changes nothing for the others."""

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.planner.cost import StepCostModel

from .conftest import OracleProposer

PROMPTS = {"a": [5, 6, 7], "b": [9, 1, 4, 4], "c": [3, 3, 3], "d": [8, 2]}


def _engine(target, drafter, proposer=None):
    return SpecEngine(target, drafter, mode="adaflash", max_batch_size=2, max_seq_len=60,
                      cost_model=StepCostModel(0.01, 0.001), proposer=proposer)


def _req(name, n=20):
    return Request(list(PROMPTS[name]), SamplingParams(max_new_tokens=n), request_id=name)


def test_abort_frees_the_slot_and_leaves_the_others_exact(target, drafter):
    """Aborting the request in slot 0 moves slot 1's request (and its caches) into it; with an
    oracle drafter that is accepted several tokens at a time, any cache left behind shows up as
    a different T=0 output."""
    reference = {o.request_id: o.output_ids for o in _engine(target, drafter).run(
        [_req("b"), _req("d")])}
    engine = _engine(target, drafter, OracleProposer(target, drafter))
    for name in "abc":
        assert engine.submit(_req(name)) is None
    engine.step()
    engine.step()
    assert [s.req.request_id for s in engine.running] == ["a", "b"]

    partial = engine.abort("a")
    assert partial.finish_reason == "abort" and partial.request_id == "a"
    assert 0 < len(partial.output_ids) < 20
    waiting = engine.abort("c")
    assert waiting.finish_reason == "abort" and waiting.output_ids == []
    assert engine.abort("c") is None and engine.abort("nobody") is None
    assert [s.req.request_id for s in engine.running] == ["b"] and not engine.waiting

    assert engine.submit(_req("d")) is None  # takes the freed slot
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert sorted(outs) == ["b", "d"]  # aborted requests never come out of step()
    assert {k: o.output_ids for k, o in outs.items()} == reference
    assert all(o.finish_reason == "length" for o in outs.values())
