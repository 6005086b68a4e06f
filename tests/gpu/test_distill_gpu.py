"""The distillation job on CUDA: one round on one GPU matches the CPU's, and (with two GPUs)
two NCCL ranks under torchrun publish what one process publishes.

What this machine's CPU tests cannot show: NCCL refuses a host tensor in a collective
(tests/training/test_opd_devices.py checks the devices on the ``meta`` device instead), and the
job's host-built blocks, calibration and evaluation have to land on the GPU.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

from tests.training.distill_volume import assert_same_round, build_volume, job_launchers, run_job

pytestmark = pytest.mark.gpu
NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}  # float32 matmuls, to compare with the CPU


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_volume(tmp_path_factory.mktemp("distill-gpu"))


def test_a_round_on_one_gpu_publishes_what_the_cpu_publishes(base, tmp_path):
    pair, home = base
    out = {}
    for device in ("cpu", "cuda:0"):
        h = tmp_path / device.replace(":", "")
        shutil.copytree(home, h)
        out[device] = run_job([sys.executable, "-m", "training_job.distill"], pair, h,
                              tmp_path / f"{h.name}.json", "--device", device, "--dtype",
                              "float32", env=NO_TF32)
    assert_same_round(out["cpu"], out["cuda:0"], 1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL across ranks needs two GPUs; this machine has fewer")
def test_two_nccl_ranks_publish_what_one_gpu_publishes(base, tmp_path):
    pair, home = base
    out = {}
    for name, launcher in job_launchers(2).items():
        h = tmp_path / name
        shutil.copytree(home, h)
        out[name] = run_job(launcher, pair, h, tmp_path / f"{name}.json", "--dtype", "float32",
                            env=NO_TF32)
    assert_same_round(out["one"], out["many"], 1e-3)
