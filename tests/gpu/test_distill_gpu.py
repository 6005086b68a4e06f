"""The distillation job on CUDA: one round on one GPU matches the CPU's, and (with two GPUs)
two NCCL ranks under torchrun publish what one process publishes.

What this machine's CPU tests cannot show: NCCL refuses a host tensor in a collective
(tests/training/test_opd_devices.py checks the devices on the ``meta`` device instead), and the
job's host-built blocks, calibration and evaluation have to land on the GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.training.distill_volume import build_volume
from tests.training.distill_volume import job_argv as _argv

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_volume(tmp_path_factory.mktemp("distill-gpu"))


def _run(launcher: list[str], pair, home, report, *extra) -> tuple[dict, dict]:
    r = subprocess.run(launcher + _argv(pair, home, report, *extra), capture_output=True,
                       text=True, timeout=900,
                       env={**os.environ, "NVIDIA_TF32_OVERRIDE": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    return (json.loads(report.read_text()),
            load_file(str(home / "drafters" / "v000002" / "model.safetensors")))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_round_on_one_gpu_publishes_what_the_cpu_publishes(base, tmp_path):
    pair, home = base
    out = {}
    for device in ("cpu", "cuda:0"):
        h = tmp_path / device.replace(":", "")
        shutil.copytree(home, h)
        out[device] = _run([sys.executable, "-m", "training_job.distill"], pair, h,
                           tmp_path / f"{device}.json", "--device", device, "--dtype", "float32")
    (rc, wc), (rg, wg) = out["cpu"], out["cuda:0"]
    assert rc["training"]["steps"] == rg["training"]["steps"]
    assert abs(rc["training"]["finalLoss"] - rg["training"]["finalLoss"]) < 1e-3
    for k in wc:
        assert (wc[k].double() - wg[k].double()).abs().max() < 1e-3, k


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL across ranks needs two GPUs; this machine has fewer")
def test_two_nccl_ranks_publish_what_one_gpu_publishes(base, tmp_path):
    pair, home = base
    out = {}
    for name, launcher in (
        ("one", [sys.executable, "-m", "training_job.distill"]),
        ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(_port()), "-m", "training_job.distill"]),
    ):
        h = tmp_path / name
        shutil.copytree(home, h)
        out[name] = _run(launcher, pair, h, tmp_path / f"{name}.json", "--dtype", "float32")
    (r1, w1), (r2, w2) = out["one"], out["two"]
    assert r1["training"]["steps"] == r2["training"]["steps"]
    assert abs(r1["training"]["finalLoss"] - r2["training"]["finalLoss"]) < 1e-3
    for k in w1:
        assert (w1[k].double() - w2[k].double()).abs().max() < 1e-3, k
