"""Why one cell's ratio moves between runs: each run's `ar`, `dflash`, `adaflash` and oracle side
by side, read from the result files already in this folder.

At T=0 `dflash`'s tau is the same in every run (the same greedy tokens, the same drafts), so a
change in `dflash / ar` between runs is the machine's price of a drafted step (a 16-token verify
plus the drafter) against a plain one, not the code. This prints, for one workload and
concurrency, every full table's figures and how `adaflash / ar` moves with `dflash / ar`.

    .venv/bin/python benchmarks/adaptive/spread.py [--workload in_domain] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("ar", "dflash", "adaflash", "oracle")


def cells(path: Path, workload: str, concurrency: int) -> dict | None:
    """The four modes' cells of one run, or None where the file lacks one of them."""
    try:
        results = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    got = {r["mode"]: r for r in results if isinstance(r, dict)
           and r.get("workload") == workload and r.get("concurrency") == concurrency}
    return got if all(m in got for m in MODES) else None


def rows(workload: str, concurrency: int) -> list[dict]:
    out = []
    for path in sorted(HERE.rglob("*.json")):
        got = cells(path, workload, concurrency)
        if got is None:
            continue
        tok = {m: got[m]["cpu_throughput_tok_s"] for m in MODES}
        out.append({"file": str(path.relative_to(HERE)), "ar": tok["ar"],
                    "dflash": tok["dflash"] / tok["ar"], "adaflash": tok["adaflash"] / tok["ar"],
                    "oracle": tok["oracle"] / tok["ar"], "dflash_tau": got["dflash"]["tau"],
                    "drafted": got["adaflash"]["drafted_share"]})
    return sorted(out, key=lambda r: r["dflash"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="in_domain")
    ap.add_argument("--concurrency", type=int, default=1)
    a = ap.parse_args()
    rs = rows(a.workload, a.concurrency)
    if len(rs) < 2:
        raise SystemExit(f"fewer than two full runs of {a.workload} c={a.concurrency} here")
    print(f"{a.workload}, c={a.concurrency}: {len(rs)} full runs (sorted by dflash / ar)\n")
    print("| file | ar tok/s | dflash tau | dflash / ar | adaflash / ar | oracle / ar "
          "| adaflash / dflash | adaflash / oracle | drafted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rs:
        print(f"| `{r['file']}` | {r['ar']:.0f} | {r['dflash_tau']:.2f} | {r['dflash']:.3f} | "
              f"{r['adaflash']:.3f} | {r['oracle']:.3f} | {r['adaflash'] / r['dflash']:.3f} | "
              f"{r['adaflash'] / r['oracle']:.3f} | {r['drafted']:.2f} |")
    ada, dfl, orc = ([r[k] for r in rs] for k in ("adaflash", "dflash", "oracle"))
    per_dfl = [x / y for x, y in zip(ada, dfl)]
    print(f"\nadaflash / ar: {min(ada):.3f}-{max(ada):.3f}; dflash / ar: {min(dfl):.3f}-{max(dfl):.3f}; "
          f"oracle / ar: {min(orc):.3f}-{max(orc):.3f}")
    print(f"adaflash / dflash: {min(per_dfl):.3f}-{max(per_dfl):.3f} "
          f"(mean {statistics.mean(per_dfl):.3f}, sd {statistics.pstdev(per_dfl):.3f})")
    print(f"Pearson r of adaflash / ar with dflash / ar: {statistics.correlation(ada, dfl):.2f}; "
          f"with oracle / ar: {statistics.correlation(ada, orc):.2f}")


if __name__ == "__main__":
    main()
