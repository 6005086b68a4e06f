"""Suite-wide settings: one intra-op thread (the CI machine has 2 shared cores, and oversubscribed
OpenMP threads make tiny-model tests an order of magnitude slower) and seeded torch."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
