"""Start ``cpu_sglang`` harness processes side by side and collect what each wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def harness_env() -> dict[str, str]:
    """The test process's environment with Triton interpreted and no ADAFLASH option leaking
    in from the caller (each run sets its own)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    for name in list(env):
        if name.startswith("ADAFLASH_") or name == "SGLANG_RAGGED_VERIFY_MODE":
            del env[name]
    return env


def run_harness(runs: dict, tmp_path_factory, timeout: float) -> dict:
    """``runs``: key -> harness arguments (without ``--out``). Returns key -> (summary, steps);
    fails the test with the log tail when a run wrote nothing or reported an error."""
    env = harness_env()
    procs = {}
    for key, args in runs.items():
        name = "-".join(str(k) for k in (key if isinstance(key, tuple) else (key,)))
        out = tmp_path_factory.mktemp(f"cpu-sglang-{name}")
        log = open(out / "log.txt", "w")
        cmd = [sys.executable, "-m", "tests.sglang_plugin.cpu_sglang", "--out", str(out), *args]
        procs[key] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log), out, log)
    results = {}
    for key, (proc, out, log) in procs.items():
        try:
            proc.wait(timeout=timeout)
        finally:
            log.close()
        path = out / "summary.json"
        if not path.exists():
            tail = (out / "log.txt").read_text()[-6000:]
            pytest.fail(f"the {key} harness wrote nothing (rc {proc.returncode}):\n{tail}")
        summary = json.loads(path.read_text())
        steps = [] if summary.get("error") else torch.load(out / "steps.pt", weights_only=True)
        results[key] = (summary, steps)
    return results
