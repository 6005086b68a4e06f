"""Where adaflash's time goes beside ar's in one cell of the adaptive benchmark: the engine's
phases (prefill, choice, drafting, verify, context, commit) timed around their methods, and
inside the choice its parts (the choice itself, its plans, the long-shot bound) and the online
cost fits', for `ar` and `adaflash` alternately, each run with a cold calibration state as
run.py's.

    python benchmarks/adaptive/phase_times.py --concurrency 64 --workload mixed --out benchmarks/adaptive/phase_times_mixed_c64.json
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

from run import cell_engine, cell_requests, one_cell  # noqa: E402

CHOICE_PARTS = ("choose", "_plan_on_host", "could_pay")  # DraftChoice's, timed on the engine's instance
PHASES = ("_prefill", "_decode_step", "_choose_drafted", "_draft", "_catch_up", "_verify_step",
          "_update_context", "_commit", "_retire")


def timed_method(method, name: str, seconds: dict, calls: collections.Counter):
    """method, wrapped to add its wall time and one call under name."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - t0
            calls[name] += 1

    return timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--workload", default="mixed", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    c = args.concurrency
    pair, prompts, n, max_seq = one_cell(args.workload, c)
    runs = []
    for mode in ("ar", "adaflash") * args.repeats:
        eng = cell_engine(pair, mode, c, prompts, n, max_seq)
        seconds, calls = collections.defaultdict(float), collections.Counter()
        for name in PHASES:
            if hasattr(eng, name):
                setattr(eng, name, timed_method(getattr(eng, name), name, seconds, calls))
        # inside _choose_drafted and the step's accounting: the draft-or-not choice and the cost fits
        parts = [(eng.choice, "choice", CHOICE_PARTS)] if mode == "adaflash" else []
        if getattr(eng, "_online_cost", None) is not None:  # made by the warm-up's first decode step
            fits = eng._online_cost
            parts += [(fits, "cost", ("observe", "model")), (fits._verify, "cost.verify_fit", ("solve",)),
                      (fits._draft, "cost.draft_fit", ("solve",))]
        for owner, prefix, names in parts:
            for name in names:
                setattr(owner, name, timed_method(getattr(owner, name), f"{prefix}.{name}", seconds, calls))
        t0 = time.perf_counter()
        outs = eng.run(cell_requests(prompts, n, 64, tuple(pair.stop_token_ids)))
        total = time.perf_counter() - t0
        tokens = sum(len(o.output_ids) for o in outs)
        run = {"mode": mode, "seconds": round(total, 3), "tok_s": round(tokens / total, 1),
               "phases": {k: {"calls": calls[k], "seconds": round(v, 3)} for k, v in seconds.items()}}
        runs.append(run)
        print(mode, f"{run['tok_s']} tok/s in {total:.2f} s",
              {k: (v["calls"], v["seconds"]) for k, v in run["phases"].items()}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["benchmarks/adaptive/phase_times.py", *sys.argv[1:]]),
                                              "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
