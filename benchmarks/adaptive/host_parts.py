"""Where a step's time goes, part by part, in place: `ar` beside `adaflash` in one cell.

profile_diff.py reads cProfile's self time, which inflates small Python functions; this wraps
the engine's parts in a wall clock instead (a perf_counter pair per call, about half a
microsecond) and times them where they run, between the target's forwards: what a small
numpy or torch call costs there, with its code and data out of the CPU's caches, is what the
engine pays, and it is several times what the same call takes in a tight loop. Each mode runs
`--repeats` times, alternating, each with a cold calibration state as run.py's timed runs; the
record holds each part's milliseconds a decode step and its calls, per mode.

    python benchmarks/adaptive/host_parts.py --workload math --concurrency 1 --repeats 3 \\
        --out benchmarks/adaptive/host_parts/math_c1_<commit>.json

Parts nest (a step's `_draft` holds the choice, which holds its plan): read each line on its
own, not as a sum. `target.forward` counts prefill forwards too.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))

from phase_times import timed_method  # noqa: E402
from run import cell_engine, cell_requests, one_cell  # noqa: E402

from sglang_adaflash.bench.machine import cpu_description  # noqa: E402
from sglang_adaflash.bench.runner import recorded_path  # noqa: E402
from sglang_adaflash.engine import draft_choice, engine  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.planner import calibration, cost  # noqa: E402

MODES = ("ar", "adaflash")
# (owner, attribute): the parts timed, by the name the record gives them
PARTS = [
    (engine.SpecEngine, "_prefill"), (engine.SpecEngine, "_draft"), (engine.SpecEngine, "_verify_step"),
    (engine.SpecEngine, "_update_context"), (engine.SpecEngine, "_commit"), (engine.SpecEngine, "_retire"),
    (engine.SpecEngine, "_cost"), (draft_choice.DraftChoice, "choose"), (draft_choice.DraftChoice, "could_pay"),
    (draft_choice.DraftChoice, "_plan_on_host"), (calibration.SurvivalPosterior, "idle"),
    (cost.OnlineCostModel, "observe"),
]


def _wrap(owner, name: str, label: str, seconds: collections.Counter, calls: collections.Counter) -> None:
    """Replace owner.name (a class's method, or an instance's) by phase_times' timed wrapper."""
    setattr(owner, name, timed_method(getattr(owner, name), label, seconds, calls))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="math", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    pair, prompts, n, max_seq = one_cell(args.workload, args.concurrency)
    seconds, calls = collections.Counter(), collections.Counter()
    _wrap(pair.target, "forward", "target.forward", seconds, calls)
    for owner, name in PARTS:
        _wrap(owner, name, f"{owner.__name__}.{name}", seconds, calls)
    per_mode = {m: {"seconds": collections.Counter(), "calls": collections.Counter(), "steps": 0, "wall_s": []}
                for m in MODES}
    for mode in MODES * args.repeats:
        eng = cell_engine(pair, mode, args.concurrency, prompts, n, max_seq)
        seconds.clear()
        calls.clear()
        before = eng.stats.steps
        t0 = time.perf_counter()
        eng.run(cell_requests(prompts, n, 64, tuple(pair.stop_token_ids)))
        wall = time.perf_counter() - t0
        rec = per_mode[mode]
        rec["seconds"].update(seconds)
        rec["calls"].update(calls)
        rec["steps"] += eng.stats.steps - before
        rec["wall_s"].append(round(wall, 3))
    parts = {}
    labels = sorted(set(per_mode["ar"]["calls"]) | set(per_mode["adaflash"]["calls"]),
                    key=lambda k: -per_mode["adaflash"]["seconds"][k])
    print(f"{args.workload} c={args.concurrency}: wall s " + "; ".join(
        f"{m} {per_mode[m]['wall_s']}" for m in MODES))
    print("| part | ar ms a step | adaflash ms a step | adaflash - ar | calls ar | calls adaflash |")
    print("|---|---|---|---|---|---|")
    for k in labels:
        ms = {m: per_mode[m]["seconds"][k] / max(per_mode[m]["steps"], 1) * 1e3 for m in MODES}
        parts[k] = {m: {"ms_per_step": round(ms[m], 4), "calls": per_mode[m]["calls"][k]} for m in MODES}
        print(f"| `{k}` | {ms['ar']:.3f} | {ms['adaflash']:.3f} | {ms['adaflash'] - ms['ar']:+.3f} | "
              f"{per_mode['ar']['calls'][k]} | {per_mode['adaflash']['calls'][k]} |")
    wall_step = {m: sum(per_mode[m]["wall_s"]) / max(per_mode[m]["steps"], 1) * 1e3 for m in MODES}
    print("whole run, ms a step: " + ", ".join(f"{m} {wall_step[m]:.3f}" for m in MODES))
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:  # no machine's absolute path in the record
        given[given.index("--out") + 1] = recorded_path(args.out)
    doc = {"command": "benchmarks/adaptive/host_parts.py " + " ".join(given), "machine": cpu_description(),
           "steps": {m: per_mode[m]["steps"] for m in MODES}, "wall_s": {m: per_mode[m]["wall_s"] for m in MODES},
           "ms_per_step": {m: round(wall_step[m], 4) for m in MODES}, "parts": parts}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
