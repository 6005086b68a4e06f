"""Side-by-side ratios of d2sd against dflash (and adaflash) from `adaflash bench` results.

    python benchmarks/d2sd/summarize.py benchmarks/d2sd/load_aware/results.json [...]

Throughput ratios are medians over repeats of the per-repeat ratio (modes of one repeat run
back to back, so a slow spell of the shared machine hits both); `cpu` ratios use this process's
CPU seconds instead of wall seconds, which other jobs on the machine disturb less.
"""

from __future__ import annotations

import json
import statistics
import sys


def paired(runs, mode, ref, c, key):
    mine = {r["repeat"]: r for r in runs if r["mode"] == mode and r["concurrency"] == c}
    theirs = {r["repeat"]: r for r in runs if r["mode"] == ref and r["concurrency"] == c}
    ratios = [mine[k][key] / theirs[k][key] for k in mine if k in theirs and theirs[k][key]]
    return statistics.median(ratios) if ratios else None


def summarize(doc: dict) -> list[dict]:
    rows = []
    by = {(r["mode"], r["concurrency"]): r for r in doc["results"]}
    for c in sorted({r["concurrency"] for r in doc["results"]}):
        d2, df = by.get(("d2sd", c)), by.get(("dflash", c))
        if d2 is None or df is None:
            continue
        tree = d2.get("tree") or {}
        steps = max(d2["steps"], 1)  # request-steps: one request's part of one decode step
        row = {
            "concurrency": c,
            "tau": {m: round(by[(m, c)]["tau"], 3) for m in ("dflash", "adaflash", "d2sd") if (m, c) in by},
            "tok_s": {m: round(by[(m, c)]["throughput_tok_s"], 1) for m in ("ar", "dflash", "adaflash", "d2sd")
                      if (m, c) in by},
            "d2sd_over_dflash": {
                "tau": round(d2["tau"] / df["tau"], 3),
                "throughput": round(paired(doc["runs"], "d2sd", "dflash", c, "throughput_tok_s"), 3),
                "throughput_cpu": round(paired(doc["runs"], "d2sd", "dflash", c, "tokens_per_cpu_s"), 3),
            },
            "verified_per_step": {m: round(by[(m, c)]["verified_tokens"] / max(by[(m, c)]["steps"], 1), 2)
                                  for m in ("dflash", "d2sd") if (m, c) in by},
            "branches_per_step": round(tree.get("branches", 0) / steps, 3),
            "branch_tokens_per_step": round(tree.get("branch_tokens", 0) / steps, 3),
            "branch_wins_per_step": round(tree.get("branch_wins", 0) / steps, 3),
        }
        if "idle_rows" in tree and tree.get("idle_rows", 0) > 0:  # --draft-off: request-steps sat out
            idle = tree["idle_rows"]
            row["sat_out"] = round(idle / steps, 3)
            # a request-step that sat out committed its bonus token alone
            row["tau_drafted"] = round((d2["committed_tokens"] - idle) / max(steps - idle, 1), 3)
        if ("adaflash", c) in by:
            row["d2sd_over_adaflash_throughput"] = round(paired(doc["runs"], "d2sd", "adaflash", c, "throughput_tok_s"), 3)
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    for path in argv:
        with open(path) as f:
            doc = json.load(f)
        print(f"## {path}  (d2sd: {doc['config'].get('d2sd')}; T=0 equality ok: {doc['equality']['ok']})")
        print("| c | tau dflash | tau adaflash | tau d2sd | d2sd/dflash tau | d2sd/dflash tok/s (wall) | (cpu) | "
              "tok/s ar / dflash / adaflash / d2sd | verified/request-step dflash, d2sd | branches, branch tokens, wins per request-step | "
              "sat out (draft-off), tau of drafted request-steps |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in summarize(doc):
            t, s, x = r["tau"], r["tok_s"], r["d2sd_over_dflash"]
            print(f"| {r['concurrency']} | {t.get('dflash')} | {t.get('adaflash', '-')} | {t['d2sd']} | {x['tau']} | "
                  f"{x['throughput']} | {x['throughput_cpu']} | {s.get('ar', '-')} / {s['dflash']} / {s.get('adaflash', '-')} / "
                  f"{s['d2sd']} | {r['verified_per_step']['dflash']}, {r['verified_per_step']['d2sd']} | "
                  f"{r['branches_per_step']}, {r['branch_tokens_per_step']}, {r['branch_wins_per_step']} | "
                  f"{r.get('sat_out', '-')}, {r.get('tau_drafted', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
