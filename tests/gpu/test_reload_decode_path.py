"""A hot reload on a CUDA drafter: the swap queues copies without waiting for the device, its
rollback copy lives in pinned memory, and the weights are right once the stream catches up."""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.drafter.checkpoint import read_checkpoint
from sglang_adaflash.serving.reload import DesiredVersionSource, HotReloader, ModuleTarget
from sglang_adaflash.testing.fixtures import drafter_config, publish_random, random_drafter

pytestmark = pytest.mark.gpu


def test_swap_on_cuda_queues_copies_and_lands(tmp_path, monkeypatch):
    home = tmp_path / "home"
    publish_random(home, seed=1)
    live = random_drafter(drafter_config(), 1).cuda()
    desired = tmp_path / "desired"
    reloader = HotReloader(
        source=DesiredVersionSource(home=home, version_file=desired),
        target=ModuleTarget(live),
        loaded_version="v000001",
    )
    version = publish_random(home, seed=2)
    desired.write_text(version)
    reloader.poll_once()
    buffers = reloader._snapshot_buffers
    assert all(t.is_pinned() for t in buffers.tensors.values())
    synchronize = torch.cuda.synchronize
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the swap waited"))
        assert reloader.at_step_boundary() == version
    synchronize()
    state = read_checkpoint(home / "drafters" / version)[1]
    for name, t in live.state_dict().items():
        torch.testing.assert_close(t.cpu(), state[name].to(t.dtype))
