"""The user GPU check of the SGLang plugin (scripts/sglang_gpu_check.py), on a CUDA machine with
sglang installed: `pytest -m "gpu and sglang" tests/gpu/test_sglang_gpu_check.py`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sglang_gpu_check.py"


def test_gpu_check_passes(tmp_path):
    pytest.importorskip("sglang")
    out = tmp_path / "gpu-check"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--requests", "32", "--max-new-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=3 * 3600,
    )
    results = out / "results.json"
    assert proc.returncode == 0, results.read_text() if results.exists() else proc.stdout[-8000:]
