"""A bench results.json as a Markdown table, each repeat apart: on a GPU the first pass over a
batch shape is slow, and a run made with the short warm-up has one cold repeat per cell, which a
median of two repeats does not remove (benchmarks/gpu/README.md).

    python benchmarks/gpu/summarize.py benchmarks/gpu/h200_767cc69/bench_bf16/results.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def table(doc: dict) -> str:
    tput, walls = defaultdict(dict), defaultdict(dict)  # (mode, c) -> {repeat: tok/s, wall s}
    for run in doc["runs"]:
        tput[(run["mode"], run["concurrency"])][run["repeat"]] = run["throughput_tok_s"]
        walls[(run["mode"], run["concurrency"])][run["repeat"]] = run["wall_s"]
    rows = {(r["mode"], r["concurrency"]): r for r in doc["results"]}
    repeats = sorted({k for v in tput.values() for k in v})
    last = repeats[-1]
    head = ("| c | mode | " + " | ".join(f"tok/s, repeat {k + 1}" for k in repeats)
            + f" | against ar, repeat {last + 1} | tau | verified per request-step | ms per batch step, repeat {last + 1} |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (mode, c), per in sorted(tput.items(), key=lambda kv: (kv[0][1], list(rows).index(kv[0]))):
        ar = tput.get(("ar", c), {}).get(last)
        r = rows[(mode, c)]
        tau = r.get("tau")
        verified = r.get("mean_verify_len")
        lines.append(f"| {c} | {mode} | " + " | ".join(f"{per[k]:.1f}" for k in repeats)
                     + f" | {per[last] / ar:.2f} |" if ar else " | - |")
        lines[-1] += f" {tau:.2f} | {verified:.2f} |" if tau is not None else " - | - |"
        # batch steps: a tree engine counts its own; else request-steps over the mean batch
        steps = (r.get("tree") or {}).get("steps") or (r["steps"] / r["mean_batch_size"] if r.get("steps") else None)
        lines[-1] += f" {1e3 * walls[(mode, c)][last] / steps:.1f} |" if steps else " - |"
    eq = doc["equality"]
    lines.append("")
    diffs = [m["first_diff"] for m in eq["mismatches"]]
    cells = len({(m["mode"], m["concurrency"]) for m in eq["mismatches"]})
    lines.append(f"T=0 equality with ar: {'every request' if eq['ok'] else f'{len(diffs)} request-runs of {cells} cells differ, first at tokens {min(diffs)}-{max(diffs)}'}"
                 + (f"; hf's agreement with ar by c: {eq['hf_exact_agreement']}" if eq.get("hf_exact_agreement") else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    for path in (argv if argv is not None else sys.argv[1:]):
        print(f"## {path}\n")
        print(table(json.load(open(path))))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
