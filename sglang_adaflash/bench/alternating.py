"""Two ways of doing one thing, timed side by side in one process: called a, b, b, a per round,
so a drift of the machine's speed (another tenant's load coming or going) falls on both alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternating_medians(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of a() and of b() over `repeats` rounds of a, b, b, a (two calls of each a
    round); one more round runs first, untimed (first calls at a shape pay one-time costs)."""
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(repeats + 1):
        for which in (0, 1, 1, 0):
            fn = a if which == 0 else b
            t0 = time.perf_counter()
            fn()
            if rep:
                times[which].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])
