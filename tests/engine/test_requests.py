"""One bad request fails alone; the rest of its batch completes exactly as it would without it."""

import math

import pytest

from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.engine.sizing import kv_cache_bytes
from sglang_adaflash.planner.cost import StepCostModel

GOOD = [[5, 6, 7], [9, 1], [3, 3, 3, 3]]


def _engine(target, drafter):
    return SpecEngine(target, drafter, mode="adaflash", max_batch_size=4, max_seq_len=40,
                      cost_model=StepCostModel(0.01, 0.001))


@pytest.mark.parametrize(
    "bad, message",
    [
        (Request([]), "prompt is empty"),
        (Request(list(range(38))), "exceeds the engine's max_seq_len"),
        (Request([1, 2, 10_000]), "outside the vocabulary"),
        (Request([1, 2], SamplingParams(temperature=-1.0)), "temperature"),
        (Request([1, 2], SamplingParams(temperature=math.nan)), "temperature"),
        (Request([1, 2], SamplingParams(temperature=1.0, top_p=0.0)), "top_p"),
        (Request([1, 2], SamplingParams(temperature=1.0, top_k=-3)), "top_k"),
        (Request([1, 2], SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (Request([1, 2], SamplingParams(stop_token_ids=(999,))), "stop_token_ids"),
    ],
)
def test_bad_request_fails_alone(target, drafter, bad, message):
    reference = _engine(target, drafter).run([Request(list(p), SamplingParams(max_new_tokens=6)) for p in GOOD])
    reqs = [Request(list(p), SamplingParams(max_new_tokens=6)) for p in GOOD]
    outs = _engine(target, drafter).run(reqs[:1] + [bad] + reqs[1:])
    assert outs[1].finish_reason == "error"
    assert message in outs[1].error
    good = outs[:1] + outs[2:]
    assert [o.output_ids for o in good] == [o.output_ids for o in reference]
    assert all(o.ok and len(o.output_ids) == 6 for o in good)


def test_top_k_beyond_the_vocabulary_keeps_all_of_it(target, drafter):
    """Any int is a valid top_k: one past int64 must not overflow the sampling tensors."""
    def sample(top_k):
        engine = SpecEngine(target, drafter, mode="dflash", max_batch_size=2, max_seq_len=40, seed=7)
        reqs = [Request(list(p), SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=6)) for p in GOOD[:2]]
        return [o.output_ids for o in engine.run(reqs)]

    assert sample(10**20) == sample(0)


def test_run_iter_yields_refusals_then_each_request_as_it_finishes(target, drafter):
    engine = _engine(target, drafter)
    reqs = [Request([5, 6, 7], SamplingParams(max_new_tokens=9), request_id="long"),
            Request([], request_id="empty"),
            Request([9, 1], SamplingParams(max_new_tokens=2), request_id="short")]
    stream = engine.run_iter(reqs)
    assert next(stream).request_id == "empty"
    assert next(stream).request_id == "short"
    assert engine.has_unfinished()  # handed over while the long request still decodes
    assert [o.request_id for o in stream] == ["long"]


def test_kv_cache_bytes_is_what_the_engine_allocates(target, drafter):
    for mode in ("ar", "dflash"):
        engine = SpecEngine(target, drafter, mode=mode, max_batch_size=3, max_seq_len=50)
        caches = [engine.cache] + ([engine.proposer.cache] if mode != "ar" else [])
        allocated = sum(t.nbytes for c in caches for t in [*c.k, *c.v])
        assert kv_cache_bytes(target, drafter, mode=mode, max_batch_size=3, max_seq_len=50) == allocated
