"""Suite-wide settings: one intra-op thread (the CI machine has 2 shared cores, and oversubscribed
OpenMP threads make tiny-model tests an order of magnitude slower) and seeded torch."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip with a reason where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
