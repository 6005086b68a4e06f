"""Two checkouts' engines on one cell of the adaptive benchmark, in alternating order: is a change
to the engine visible beside the cell's own run-to-run spread?

Each round runs `run.py --modes ar,adaflash --repeats 1 --extra-pairs 2` in each checkout (its own
package, its own process), the order flipped every round so a drift of the machine's speed falls
on both. Prints and records every run's `adaflash / ar` (paired, and by medians of the run's CPU
time) and the medians per checkout.

    python benchmarks/adaptive/ab_engines.py --a OLD_CHECKOUT --b NEW_CHECKOUT --workload in_domain \
        --concurrency 8 --rounds 4 --out benchmarks/adaptive/checks/ab_in_domain_c8.json

A checkout is a directory holding this repository at some commit (`git worktree add`, or `git
archive COMMIT | tar -x -C DIR`) with its assets; both use the Python that runs this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from sglang_adaflash.bench.runner import recorded_path  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402


def one_run(checkout: Path, workload: str, concurrency: int, out: Path) -> dict:
    """One run.py run of the cell in `checkout`: adaflash's paired and median ratios to ar."""
    subprocess.run([sys.executable, "benchmarks/adaptive/run.py", "--out", str(out), "--concurrency",
                    str(concurrency), "--workloads", workload, "--modes", "ar,adaflash", "--repeats", "1",
                    "--extra-pairs", "2"], cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    ada = next(r for r in doc["results"] if r["mode"] == "adaflash")
    return {"paired_vs_ar": ada["paired_vs_ar"], "cpu_vs_ar": ada["cpu_vs_ar"],
            "drafted_share": ada["drafted_share"], "equality_ok": doc["equality_ok"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, type=Path, help="the first checkout (e.g. main before the change)")
    ap.add_argument("--b", required=True, type=Path, help="the second checkout")
    ap.add_argument("--label-a", default="a")
    ap.add_argument("--label-b", default="b")
    ap.add_argument("--workload", default="in_domain", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    sides = {args.label_a: args.a.resolve(), args.label_b: args.b.resolve()}
    for label, path in sides.items():
        if not (path / "benchmarks" / "adaptive" / "run.py").is_file():
            ap.error(f"{label}: {path} holds no benchmarks/adaptive/run.py")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for label in order:
                got = one_run(sides[label], args.workload, args.concurrency, Path(tmp) / f"{label}_{r}.json")
                runs.append({"round": r, "checkout": label, **got})
                print(f"round {r} {label}: paired {got['paired_vs_ar']:.3f}  by medians {got['cpu_vs_ar']:.3f}"
                      f"  drafted {got['drafted_share']:.2f}", flush=True)
    summary = {}
    for label in sides:
        mine = [x for x in runs if x["checkout"] == label]
        summary[label] = {k: statistics.median(x[k] for x in mine) for k in ("paired_vs_ar", "cpu_vs_ar")}
        summary[label]["range_cpu_vs_ar"] = [min(x["cpu_vs_ar"] for x in mine), max(x["cpu_vs_ar"] for x in mine)]
        print(f"{label}: median paired {summary[label]['paired_vs_ar']:.3f}, by medians "
              f"{summary[label]['cpu_vs_ar']:.3f} (runs {summary[label]['range_cpu_vs_ar'][0]:.3f}-"
              f"{summary[label]['range_cpu_vs_ar'][1]:.3f})")
    ok = all(x["equality_ok"] for x in runs)
    print("T=0 equality with ar in every run:", "OK" if ok else "MISMATCH")
    if args.out:
        # the checkouts are recorded by label only: their paths are this machine's
        cmd = ["benchmarks/adaptive/ab_engines.py", "--a", "<a>", "--b", "<b>", "--label-a", args.label_a,
               "--label-b", args.label_b, "--workload", args.workload, "--concurrency", str(args.concurrency),
               "--rounds", str(args.rounds), "--out", recorded_path(args.out)]
        write_text_atomic(args.out, json.dumps({"command": " ".join(cmd), "equality_ok": ok, "runs": runs,
                                                "summary": summary}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
