"""Suite-wide settings: one intra-op thread (the CI machine has 2 shared cores, and oversubscribed
OpenMP threads make tiny-model tests an order of magnitude slower) and seeded torch; the default
tiny random pair, one per test module (a module needing another defines its own)."""

import pytest
import torch

from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip with a reason where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
