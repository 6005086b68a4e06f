"""Where adaflash's host time goes beside ar's in one cell: cProfile's self time per function,
per decode step, adaflash minus ar, the functions that differ most first.

`phase_times.py` times the engine's phases with a wall clock; this reads the functions under
them (the choice, the planner, the posterior, the feature queue, torch's ops), at cProfile's
cost (it inflates Python-heavy functions, so read differences, not absolute times). Each mode
runs `--repeats` times, alternating, each timed run with a cold calibration state as run.py's.

    python benchmarks/adaptive/profile_diff.py --workload math --concurrency 32 --repeats 2 --top 30
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))

from run import cell_engine, cell_requests, one_cell  # noqa: E402

MODES = ("ar", "adaflash")


def _where(filename: str, line: int, name: str) -> str:
    for root in (str(ROOT) + "/", "site-packages/"):
        if root in filename:
            filename = filename.split(root, 1)[1]
    return f"{filename}:{line}({name})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="math", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    pair, prompts, n, max_seq = one_cell(args.workload, args.concurrency)
    self_time = {m: collections.Counter() for m in MODES}
    calls = {m: collections.Counter() for m in MODES}
    steps, seconds = collections.Counter(), collections.defaultdict(list)
    for mode in MODES * args.repeats:
        eng = cell_engine(pair, mode, args.concurrency, prompts, n, max_seq)
        requests = cell_requests(prompts, n, 64, tuple(pair.stop_token_ids))
        before, prof = eng.stats.steps, cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        eng.run(requests)
        prof.disable()
        seconds[mode].append(time.perf_counter() - t0)
        steps[mode] += eng.stats.steps - before
        for (filename, line, name), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
            key = _where(filename, line, name)
            self_time[mode][key] += tottime
            calls[mode][key] += ncalls
    print(f"{args.workload} c={args.concurrency}: seconds " + ", ".join(
        f"{m} {' '.join(f'{s:.2f}' for s in seconds[m])}" for m in MODES) + f"; steps {dict(steps)}")
    per_step = {m: {k: v / steps[m] * 1e3 for k, v in self_time[m].items()} for m in MODES}
    keys = sorted(set(per_step["ar"]) | set(per_step["adaflash"]),
                  key=lambda k: -(per_step["adaflash"].get(k, 0.0) - per_step["ar"].get(k, 0.0)))
    print("| ms a step, adaflash - ar | ar | adaflash | calls ar | calls adaflash | function |")
    print("|---|---|---|---|---|---|")
    for k in keys[: args.top]:
        a, b = per_step["ar"].get(k, 0.0), per_step["adaflash"].get(k, 0.0)
        print(f"| {b - a:.4f} | {a:.4f} | {b:.4f} | {calls['ar'][k]} | {calls['adaflash'][k]} | `{k}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
