"""The same tiny float64 pair as the CLI tests, plus a small workload with domains."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sglang_adaflash.testing import build_tiny_pair, write_tiny_workload
from tests.cli.conftest import TINY


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("pair") / "p", seed=0, **TINY)


@pytest.fixture(scope="session")
def workload(tmp_path_factory):
    return write_tiny_workload(tmp_path_factory.mktemp("wl") / "w.jsonl", num_prompts=5, seed=0)


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(relative: str):
    """A script under benchmarks/ (not a package) imported as a module, e.g. "adaptive/bound.py"."""
    path = BENCHMARKS / relative
    spec = importlib.util.spec_from_file_location("benchmark_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
