"""Whether each cell of the adaptive table meets its goal, with a confidence interval, from the
paired runs the table already records.

A cell's `paired_samples` are `adaflash / ar` of runs made back to back (`run.py
--extra-pairs N`, alternating which goes first); their median is the table's paired ratio. On
this machine one cell's pairs spread over +-20%, so a median of 8 can sit on either side of a
goal 5% away by chance. This reads every result file given, pools each cell's pairs over the
files, and gives the median with a distribution-free confidence interval (order statistics:
the interval [x_(l), x_(n+1-l)] holds the true median with probability
1 - 2 P(Binomial(n, 1/2) < l), no assumption on the ratio's distribution), then the verdict:
**met** where the whole interval is at or above the goal, **missed** where it is below,
**undecided** where it straddles it (more pairs decide it).

The goal of a cell against max(`ar`, `dflash`) is read against `ar` where `ar` is the faster
fixed mode in the cell's medians; where `dflash` is faster the pairs are scaled by the cell's
`ar / dflash` (what `run.py`'s `paired_vs_best_fixed` does), which the interval does not widen for.

    .venv/bin/python benchmarks/adaptive/verdict.py benchmarks/adaptive/more_pairs/results.json \
        benchmarks/adaptive/more_pairs/between.json [--level 0.95] [--goal 0.95] [--c1-goal 1.15]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def median_ci(samples: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(lower, upper, coverage) of the order-statistic interval for the median with coverage at
    least ``level``, the narrowest such; None when even [min, max] covers less (too few samples)."""
    x = sorted(samples)
    n = len(x)
    if n == 0:
        return None
    # P(Binomial(n, 1/2) <= k), cumulated
    cdf, acc = [], 0.0
    for k in range(n + 1):
        acc += math.comb(n, k) / 2 ** n
        cdf.append(acc)
    best = None
    for lo in range(1, n // 2 + 1):  # 1-based rank of the lower end; the upper is n + 1 - lo
        coverage = 1 - 2 * cdf[lo - 1]
        if coverage >= level:
            best = (x[lo - 1], x[n - lo], coverage)
    return best


def verdict(ci: tuple[float, float, float] | None, goal: float) -> str:
    if ci is None:
        return "too few pairs"
    lo, hi, _ = ci
    return "met" if lo >= goal else "missed" if hi < goal else "undecided"


def cells(paths: list[Path]) -> dict[tuple[str, int], dict]:
    """Per (workload, concurrency): the pooled pairs against the best fixed mode, and the files."""
    out: dict[tuple[str, int], dict] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        rows = [r for r in doc.get("results", []) if isinstance(r, dict)]
        by_cell: dict[tuple[str, int], dict[str, dict]] = {}
        for r in rows:
            by_cell.setdefault((r["workload"], r["concurrency"]), {})[r["mode"]] = r
        for key, modes in by_cell.items():
            ada = modes.get("adaflash")
            if not ada or not ada.get("paired_samples"):
                continue
            scale = 1.0
            if "dflash" in modes and "ar" in modes:
                ar, dfl = modes["ar"]["cpu_throughput_tok_s"], modes["dflash"]["cpu_throughput_tok_s"]
                scale = min(1.0, ar / dfl)
            cell = out.setdefault(key, {"vs_ar": [], "vs_best": [], "files": 0})
            cell["vs_ar"] += ada["paired_samples"]
            cell["vs_best"] += [s * scale for s in ada["paired_samples"]]
            cell["files"] += 1
    return out


def table(paths: list[Path], level: float, goal: float, c1_goal: float) -> list[dict]:
    rows = []
    for (workload, c), cell in sorted(cells(paths).items()):
        ci_best = median_ci(cell["vs_best"], level)
        row = {"workload": workload, "concurrency": c, "pairs": len(cell["vs_ar"]), "files": cell["files"],
               "median_vs_best": statistics.median(cell["vs_best"]), "ci_vs_best": ci_best,
               "goal_vs_best": goal, "verdict_vs_best": verdict(ci_best, goal)}
        if workload == "in_domain" and c == 1:
            ci_ar = median_ci(cell["vs_ar"], level)
            row.update(median_vs_ar=statistics.median(cell["vs_ar"]), ci_vs_ar=ci_ar,
                       goal_vs_ar=c1_goal, verdict_vs_ar=verdict(ci_ar, c1_goal))
        rows.append(row)
    return rows


def _ci(ci) -> str:
    return "-" if ci is None else f"{ci[0]:.3f}-{ci[1]:.3f} ({ci[2]:.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="run.py result files with paired_samples")
    ap.add_argument("--level", type=float, default=0.95, help="the interval's coverage, at least")
    ap.add_argument("--goal", type=float, default=0.95, help="adaflash / max(ar, dflash) in every cell")
    ap.add_argument("--c1-goal", type=float, default=1.15, help="adaflash / ar, in-domain c=1")
    a = ap.parse_args(argv)
    rows = table(a.files, a.level, a.goal, a.c1_goal)
    if not rows:
        raise SystemExit("no cell with paired samples in the files given")
    print(f"paired adaflash / max(ar, dflash): median and an interval of coverage >= {a.level} "
          f"(actual coverage in brackets)\n")
    print("| workload | c | pairs | median | interval | goal | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['concurrency']} | {r['pairs']} | {r['median_vs_best']:.3f} | "
              f"{_ci(r['ci_vs_best'])} | >= {r['goal_vs_best']} | {r['verdict_vs_best']} |")
        if "verdict_vs_ar" in r:
            print(f"| {r['workload']} (vs ar) | {r['concurrency']} | {r['pairs']} | {r['median_vs_ar']:.3f} | "
                  f"{_ci(r['ci_vs_ar'])} | >= {r['goal_vs_ar']} | {r['verdict_vs_ar']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
