"""benchmarks/adaptive/bound.py's oracle: lossless, and right about every draft it verifies.

The oracle's figures are a ceiling only if its table of accepted proposals is exact. Too high,
and it verifies proposals that are rejected; too low, and it leaves accepted tokens on the
table, which lowers the ceiling. The table is checked against the real engine's own accepts
(mode dflash, every step, one request at a time), and a table read one position late must show.
"""

from __future__ import annotations

import pytest

from sglang_adaflash.assets import MODELS_DIR, WORKLOADS_DIR
from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.engine.request import Request
from sglang_adaflash.launch.loading import load_pair
from sglang_adaflash.launch.prompts import read_prompts, resolve_prompt_ids
from tests.bench.conftest import load_benchmark


@pytest.fixture(scope="module")
def setup():
    bound = load_benchmark("adaptive/bound.py")
    pair = load_pair(MODELS_DIR / "target", MODELS_DIR / "drafter", dtype="float32")
    prompts = [resolve_prompt_ids(p, pair.tokenizer) for p in read_prompts(WORKLOADS_DIR / "code.heldout.jsonl")[:3]]

    def requests():
        return [Request(list(p), SamplingParams(max_new_tokens=24), f"r{i}") for i, p in enumerate(prompts)]

    ar = SpecEngine(pair.target, None, mode="ar", max_batch_size=3, max_seq_len=400)
    reference = {o.request_id: o.output_ids for o in ar.run(requests())}
    return bound, pair, requests, reference


@pytest.mark.parametrize("late", [0, 1])  # 1: the control, each table read one position late
def test_the_oracle_is_lossless_and_verifies_only_what_is_accepted(setup, late):
    bound, pair, requests, reference = setup
    block = pair.drafter.config.block_size
    tables = {r.request_id: bound.foresee(pair, r.prompt_ids, reference[r.request_id], block_size=block)
              for r in requests()}
    tables = {k: v[late:] + [0] * late for k, v in tables.items()}
    eng = bound.OracleEngine(pair.target, pair.drafter, max_batch_size=3, max_seq_len=400, seed=0,
                             accepted=tables, a_min=1)
    outs = eng.run(requests())
    assert {o.request_id: o.output_ids for o in outs} == reference  # lossless whatever it foresees
    accepted = sum(o.stats.committed_tokens - o.stats.steps for o in outs)
    drafted = sum(1 for o in outs for v in o.stats.verify_lens if v > 1)
    if late:
        assert accepted < eng.foreseen, "a table one position late must foresee accepts that do not happen"
    else:
        assert drafted > 3 and accepted == eng.foreseen  # it drafted, and every proposal it verified held


def test_the_table_equals_what_the_engine_accepts_at_every_step(setup):
    """Mode dflash drafts the whole block at every step; each step's accepted proposals must be
    the table's entry at that step's committed length, capped by the tokens still to generate."""
    bound, pair, requests, reference = setup
    block = pair.drafter.config.block_size
    eng = SpecEngine(pair.target, pair.drafter, mode="dflash", max_batch_size=1, max_seq_len=400)
    checked = 0
    for r in requests():
        table = bound.foresee(pair, r.prompt_ids, reference[r.request_id], block_size=block)
        out = eng.run([r])[0]
        assert out.output_ids == reference[r.request_id]
        m = 1  # prefill commits the first token
        for tau in out.stats.accept_lens:
            cap = min(block, r.sampling.max_new_tokens - m)
            assert tau - 1 == min(table[m], cap - 1), (r.request_id, m)
            m += tau
            checked += 1
    assert checked > 20
