"""Host timers over device work.

CUDA queues kernels and returns at once, so a timer read right after a launch measures the
launch, not the work: the step-cost model would price a forward at its Python overhead, and the
draft/verify split of the stats would hand one phase's kernels to the next. `synced_time` waits
for the device's queue before it reads the clock. Every step ends in a host read of its results
anyway (the committed tokens), so the waits cost the engine nothing it would not pay.
"""

from __future__ import annotations

import time

import torch


def synced_time(device: torch.device | str) -> float:
    """time.perf_counter() once the work queued on `device` is done (CPU work already is)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
