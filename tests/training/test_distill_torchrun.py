"""The whole job under torchrun with two gloo ranks publishes what one process publishes."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from .distill_volume import job_argv as _argv

pytestmark = pytest.mark.slow  # two torchrun workers and one plain run: about 60 s here


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_ranks_publish_the_single_process_weights(base, tmp_path):
    pair, home = base
    out = {}
    for name, launcher in (
        ("one", [sys.executable, "-m", "training_job.distill"]),
        ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(_port()), "-m", "training_job.distill"]),
    ):
        h = tmp_path / name
        shutil.copytree(home, h)
        report = tmp_path / f"{name}.json"
        r = subprocess.run(launcher + _argv(pair, h, report), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = (json.loads(report.read_text()),
                     load_file(str(h / "drafters" / "v000002" / "model.safetensors")))
    (r1, w1), (r2, w2) = out["one"], out["two"]
    assert r1["training"]["steps"] == r2["training"]["steps"]
    assert abs(r1["training"]["finalLoss"] - r2["training"]["finalLoss"]) < 1e-4
    assert r1["eval"]["parentTau"] == r2["eval"]["parentTau"]
    for k in w1:
        assert (w1[k].double() - w2[k].double()).abs().max() < 1e-5, k
