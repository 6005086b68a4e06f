"""Summarise repeated runs of one `benchmarks/adaptive/run.py` cell per drafter.

    python benchmarks/drafter_recipe/c1_repeats.py benchmarks/drafter_recipe/stage2/adaptive_in_domain_c1_*.json \
        benchmarks/drafter_recipe/stage2/repeats/*.json

Each file is one run of the in-domain c=1 cell (`run.py --concurrency 1 --workloads in_domain
[--drafter DIR]`); the drafter is read from the run's config. Prints, per drafter, every run's
`adaflash`/`ar` (medians of the run's repeats, and paired), oracle/`ar`, `adaflash`/oracle and the
share of request-steps drafted, then the median over runs. Runs of different drafters were made
in alternating order, so a drift of the machine's speed falls on both.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def row(path: Path) -> tuple[str, dict]:
    d = json.loads(path.read_text())
    by = {r["mode"]: r for r in d["results"]}
    ar, ada, orc = by["ar"], by["adaflash"], by["oracle"]
    drafter = Path(d["config"].get("drafter") or "shipped").name.removeprefix("drafter_")
    return drafter, {
        "run": path.name,
        "adaflash/ar": ada["throughput_tok_s"] / ar["throughput_tok_s"],
        "paired": ada.get("paired_vs_ar"),
        "oracle/ar": orc["throughput_tok_s"] / ar["throughput_tok_s"],
        "adaflash/oracle": ada["throughput_tok_s"] / orc["throughput_tok_s"],
        "drafted": ada["drafted_share"],
        "dflash tau": by["dflash"]["tau"],
    }


def main(argv: list[str]) -> int:
    runs: dict[str, list[dict]] = {}
    for p in argv:
        name, r = row(Path(p))
        runs.setdefault(name, []).append(r)
    keys = ["adaflash/ar", "paired", "oracle/ar", "adaflash/oracle", "drafted", "dflash tau"]
    print("| drafter | run | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, rs in sorted(runs.items()):
        for r in rs:
            print(f"| {name} | {r['run']} | " + " | ".join(
                "-" if r[k] is None else f"{r[k]:.3f}" for k in keys) + " |")
        med = {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in keys
               if any(r[k] is not None for r in rs)}
        print(f"| **{name}** | median of {len(rs)} | " + " | ".join(
            f"**{med[k]:.3f}**" if k in med else "-" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
