"""What the draft-or-not choice drafts in one cell where drafting pays nowhere: first reads,
probes, planned rows, and whether a drafter that is always right could pay at the prices fitted.

Each timed run of run.py starts with a cold posterior (no domain history) on an engine whose
cost model carries over from the runs before. This serves one cell `--runs` times that way,
after run.py's warm-up, counting per run: the steps that drafted anyone, the forced rows
(first reads and probes) and the planned rows, the steps that drafted forced rows only, the
most rows one step drafted, and at the end of the run the fitted prices and
DraftChoice.perfect_could_pay at the cell's batch size; and, for comparison, a fresh start-up
profile (what the cost model starts from). Not a speed measurement.

    python benchmarks/adaptive/first_reads.py --workload in_domain --concurrency 32 \\
        --out benchmarks/adaptive/first_reads/in_domain_c32_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))

from run import cell_engine, cell_requests, one_cell  # noqa: E402

from sglang_adaflash.bench.machine import cpu_description  # noqa: E402
from sglang_adaflash.bench.runner import recorded_path  # noqa: E402
from sglang_adaflash.engine.sizing import profile_step_cost  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="in_domain", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    pair, prompts, n, max_seq = one_cell(args.workload, args.concurrency)
    eng = cell_engine(pair, "adaflash", args.concurrency, prompts, n, max_seq)
    counts: dict[str, int] = {}
    choose = eng.choice.choose

    def counted(seqs, caps, cost, *, measured):
        drafted, forced = choose(seqs, caps, cost, measured=measured)
        counts["steps"] += 1
        counts["drafted_steps"] += bool(drafted)
        counts["forced_rows"] += len(forced)
        counts["planned_rows"] += len(drafted) - len(forced)
        counts["forced_only_steps"] += bool(drafted) and len(forced) == len(drafted)
        counts["most_rows_a_step"] = max(counts["most_rows_a_step"], len(drafted))
        return drafted, forced

    eng.choice.choose = counted
    runs = []
    for _ in range(args.runs):
        counts.update(steps=0, drafted_steps=0, forced_rows=0, planned_rows=0, forced_only_steps=0,
                      most_rows_a_step=0)
        eng.posterior = eng.posterior.fresh()
        eng.run(cell_requests(prompts, n, 64, tuple(pair.stop_token_ids)))
        cost = eng._online_cost.model(args.concurrency)
        runs.append({**counts, "fitted_prices_at_c": asdict(cost),
                     "perfect_could_pay_at_c": eng.choice.perfect_could_pay(args.concurrency, cost)})
        print(json.dumps(runs[-1]), flush=True)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:  # no machine's absolute path in the record
        given[given.index("--out") + 1] = recorded_path(args.out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        profile = asdict(profile_step_cost(eng))
        write_text_atomic(args.out, json.dumps({"command": "benchmarks/adaptive/first_reads.py " + " ".join(given),
                                                "machine": cpu_description(), "start_up_profile": profile,
                                                "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
