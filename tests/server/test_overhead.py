"""The server-overhead benchmark runs end to end and records no machine path (slow: it starts
`adaflash serve` as a child process)."""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.server import overhead
from sglang_adaflash.testing.tiny_pair import write_tiny_workload


@pytest.mark.slow
def test_overhead_benchmark_writes_results_with_equal_outputs(pair, tmp_path):
    prompts = write_tiny_workload(tmp_path / "w.jsonl", num_prompts=3)
    out = tmp_path / "out"
    code = overhead.main(["--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                          "--prompts", str(prompts), "--concurrency", "1,2", "--max-new-tokens", "6",
                          "--waves", "1", "--repeats", "1", "--threads", "1", "--ignore-eos",
                          "--out", str(out)])
    assert code == 0
    text = (out / overhead.RESULTS_NAME).read_text()
    doc = json.loads(text)
    assert doc["equality"] == {"ok": True, "mismatches": 0}
    assert [r["concurrency"] for r in doc["results"]] == [1, 2]
    assert all(r["http_tok_s"] > 0 and r["direct_tok_s"] > 0 for r in doc["results"])
    assert str(tmp_path) not in text and doc["command"].startswith("python -m sglang_adaflash.server.overhead")
