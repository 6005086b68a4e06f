"""synced_time waits for a CUDA device's queue before it reads the clock, and never on the CPU
(where there is no queue), so engine timers price kernels, not their launches."""

from __future__ import annotations

import torch

from sglang_adaflash.core import clock


def test_waits_for_cuda_only(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(torch.device(device)))
    t0 = clock.synced_time("cpu")
    assert waited == []
    t1 = clock.synced_time(torch.device("cuda", 1))
    t2 = clock.synced_time("cuda")
    assert waited == [torch.device("cuda", 1), torch.device("cuda")]
    assert t0 <= t1 <= t2
