"""Compact verification on SGLang's Triton attention, through the plugin's own path, on CPU.

``cpu_sglang --attention triton`` serves the embedded pair in SGLang's scheduler with SGLang's
Triton attention backend as the target's (its extend kernel interpreted under
``TRITON_INTERPRET=1``); in compact mode the plugin registers its ragged-verify subclass of it.
Greedy requests of different lengths run, one joining mid-run, once compact and once fixed: the
outputs must be equal token for token (both are the target's greedy decoding). With the layout
ignored (SGLang's own Triton backend: uniform query offsets over packed rows) every request but
the first reads another request's rows, and the outputs differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(2400)]
pytest.importorskip("sglang")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def triton_runs(tmp_path_factory):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    for name in list(env):
        if name.startswith("ADAFLASH_") or name == "SGLANG_RAGGED_VERIFY_MODE":
            del env[name]
    procs = {}
    for mode in ("compact", "fixed"):
        out = tmp_path_factory.mktemp(f"triton-{mode}")
        cmd = [sys.executable, "-m", "tests.sglang_plugin.cpu_sglang", "--out", str(out),
               "--mode", mode, "--dispatch", "triton", "--attention", "triton", "--light",
               "--max-new", "12"]  # fmt: skip
        log = open(out / "log.txt", "w")
        procs[mode] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log), out, log)
    results = {}
    for mode, (proc, out, log) in procs.items():
        try:
            proc.wait(timeout=2300)
        finally:
            log.close()
        path = out / "summary.json"
        if not path.exists():
            pytest.fail(f"the {mode} run wrote nothing:\n{(out / 'log.txt').read_text()[-6000:]}")
        summary = json.loads(path.read_text())
        assert not summary.get("error"), summary["error"]
        results[mode] = summary
    return results


def test_compact_on_triton_equals_fixed(triton_runs):
    compact, fixed = triton_runs["compact"], triton_runs["fixed"]
    assert compact["worker"]["target_backend"] == "RaggedVerifyTritonBackend"
    assert compact["worker"]["mode"] == "compact" and fixed["worker"]["mode"] == "fixed"
    assert set(compact["outputs"]) == {"g0", "g1", "join"}
    assert compact["outputs"] == fixed["outputs"]
    assert compact["sync_trap"]["violations"] == []
