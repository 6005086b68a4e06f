"""How one cell of the adaptive benchmark moves between runs: each run's `ar`, `dflash`,
`adaflash` and oracle side by side, and the medians over runs per drafter.

At T=0 `dflash`'s tau is the same in every run with one drafter (the same greedy tokens, the
same drafts), so a change in `dflash / ar` between such runs is the machine's price of a drafted
step (a 16-token verify plus the drafter) against a plain one, not the code. This prints, for one
workload and concurrency, every run's figures, how `adaflash / ar` moves with `dflash / ar`, and
per drafter (the run's `--drafter`, else the shipped one) the median of every column over its
runs: what repeated runs of one cell say where a single run's ratio moves by 5-10%.

    .venv/bin/python benchmarks/adaptive/spread.py [--workload in_domain] [--concurrency 1] [FILE ...]

With no FILE it reads every result file under benchmarks/adaptive/ that has the cell in all four
modes; repeated runs of the cell alone (`run.py --concurrency 1 --workloads in_domain [--drafter
DIR]`) are given as files, e.g. benchmarks/drafter_recipe/stage2/repeats/*.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("ar", "dflash", "adaflash", "oracle")
COLUMNS = ("ar", "dflash_tau", "dflash", "adaflash", "paired", "oracle", "adaflash/oracle", "drafted")


def cells(path: Path, workload: str, concurrency: int) -> tuple[dict, dict] | None:
    """(the four modes' cells, the run's config) of one run, or None where the file lacks one of them."""
    try:
        doc = json.loads(path.read_text())
        results = doc["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(results, list):
        return None
    got = {r["mode"]: r for r in results if isinstance(r, dict)
           and r.get("workload") == workload and r.get("concurrency") == concurrency}
    return (got, doc.get("config") or {}) if all(m in got for m in MODES) else None


def _name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(HERE.parents[1]))
    except ValueError:
        return path.name


def rows(workload: str, concurrency: int, files: list[Path] | None = None) -> list[dict]:
    out = []
    for path in files if files else sorted(HERE.rglob("*.json")):
        found = cells(path, workload, concurrency)
        if found is None:
            continue
        got, config = found
        tok = {m: got[m]["cpu_throughput_tok_s"] for m in MODES}
        out.append({"file": _name(path),
                    "drafter": Path(config.get("drafter") or "shipped").name.removeprefix("drafter_"),
                    "ar": tok["ar"], "dflash_tau": got["dflash"]["tau"],
                    "dflash": tok["dflash"] / tok["ar"], "adaflash": tok["adaflash"] / tok["ar"],
                    "paired": got["adaflash"].get("paired_vs_ar"),
                    "oracle": tok["oracle"] / tok["ar"], "adaflash/oracle": tok["adaflash"] / tok["oracle"],
                    "drafted": got["adaflash"]["drafted_share"]})
    return sorted(out, key=lambda r: r["dflash"])


def medians(rs: list[dict]) -> dict[str, dict]:
    """Per drafter, the median of every column over its runs (columns some run lacks: over the others)."""
    by: dict[str, list[dict]] = {}
    for r in rs:
        by.setdefault(r["drafter"], []).append(r)
    return {name: {"runs": len(group), **{k: statistics.median(v) for k in COLUMNS
                                          if (v := [r[k] for r in group if r[k] is not None])}}
            for name, group in sorted(by.items())}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="in_domain")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("files", nargs="*", type=Path, help="result files (default: every one under benchmarks/adaptive/)")
    a = ap.parse_args(argv)
    rs = rows(a.workload, a.concurrency, a.files)
    if len(rs) < 2:
        raise SystemExit(f"fewer than two full runs of {a.workload} c={a.concurrency} in the files read")
    print(f"{a.workload}, c={a.concurrency}: {len(rs)} full runs (sorted by dflash / ar; CPU-time throughput)\n")
    print("| file | drafter | ar tok/s | dflash tau | dflash / ar | adaflash / ar | paired adaflash / ar "
          "| oracle / ar | adaflash / oracle | drafted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rs:
        print(f"| `{r['file']}` | {r['drafter']} | {r['ar']:.0f} | {r['dflash_tau']:.2f} | {r['dflash']:.3f} | "
              f"{r['adaflash']:.3f} | {_cell(r['paired'], '.3f')} | {r['oracle']:.3f} | "
              f"{r['adaflash/oracle']:.3f} | {r['drafted']:.2f} |")
    print("\n| drafter | runs | adaflash / ar | paired | oracle / ar | adaflash / oracle | drafted | dflash tau |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in medians(rs).items():
        print(f"| {name} | {m['runs']} | " + " | ".join(
            _cell(m.get(k), ".3f") for k in ("adaflash", "paired", "oracle", "adaflash/oracle", "drafted", "dflash_tau"))
              + " |")
    ada, dfl, orc = ([r[k] for r in rs] for k in ("adaflash", "dflash", "oracle"))
    per_dfl = [x / y for x, y in zip(ada, dfl)]
    print(f"\nadaflash / ar: {min(ada):.3f}-{max(ada):.3f}; dflash / ar: {min(dfl):.3f}-{max(dfl):.3f}; "
          f"oracle / ar: {min(orc):.3f}-{max(orc):.3f}")
    print(f"adaflash / dflash: {min(per_dfl):.3f}-{max(per_dfl):.3f} "
          f"(mean {statistics.mean(per_dfl):.3f}, sd {statistics.pstdev(per_dfl):.3f})")
    if len(rs) > 2 and statistics.pstdev(ada) > 0 and statistics.pstdev(dfl) > 0 and statistics.pstdev(orc) > 0:
        print(f"Pearson r of adaflash / ar with dflash / ar: {statistics.correlation(ada, dfl):.2f}; "
              f"with oracle / ar: {statistics.correlation(ada, orc):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
