"""Several ways of doing one thing, timed side by side in one process, in rounds: so a drift of
the machine's speed (another tenant's load coming or going) falls on each alike. Two ways run
a, b, b, a per round (alternating_medians); more, once each per round (round_robin_medians)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


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


def round_robin_medians(fns: Mapping[object, Callable[[], object]], rounds: int) -> dict:
    """Median seconds of each fns[k]() over `rounds` rounds, each calling every one once in
    order; one more round runs first, untimed."""
    times: dict = {k: [] for k in fns}
    for rep in range(rounds + 1):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
