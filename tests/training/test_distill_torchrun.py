"""The whole job under torchrun with two gloo ranks publishes what one process publishes."""

from __future__ import annotations

import shutil

import pytest

from .distill_volume import assert_same_round, job_launchers, run_job

pytestmark = pytest.mark.slow  # two torchrun workers and one plain run: about 60 s here


def test_torchrun_two_ranks_publish_the_single_process_weights(base, tmp_path):
    pair, home = base
    out = {}
    for name, launcher in job_launchers(2).items():
        h = tmp_path / name
        shutil.copytree(home, h)
        out[name] = run_job(launcher, pair, h, tmp_path / f"{name}.json")
    assert_same_round(out["one"], out["many"], 1e-5)
    assert out["one"][0]["eval"]["parentTau"] == out["many"][0]["eval"]["parentTau"]
