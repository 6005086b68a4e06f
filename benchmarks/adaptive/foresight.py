"""What the load-aware rule expected of each step against what the step gave, in one cell.

The rule drafts a batch when its cost model and the posterior say the drafted step yields more
tokens per second than a plain one. This script runs `ar` and then `adaflash` on one cell of
the adaptive benchmark (engines built as run.py builds them: warm, then a cold calibration
state) and, for every adaflash decode step, records what the plan read and predicted (expected
committed tokens, the step's seconds by the cost model, a plain step's seconds by the same model)
beside what the step did (committed tokens, measured seconds). `ar`'s own steps give a plain
step's measured seconds at each batch size. Per batch size and kind of step (drafted or plain),
it prints the means and the two speedups over a plain step: the one the rule foresaw and the one
the step realised. Where the foreseen gain is above the realised one, the rule drafts steps that
do not pay; where it is below, it leaves gains on the table.

At T=0 every run commits `ar`'s tokens, so the oracle's table (oracle.foresee) says how many of
the drafter's proposals the target would accept at every row-step, drafted or not. The second
table splits the row-steps by the rule's decision: how often a row left plain would have accepted
anything, how much, and, for drafted rows, the slots verified, the proposals accepted and what
the whole block would have given.

    python benchmarks/adaptive/foresight.py --concurrency 1 --workload in_domain --out foresight_in_domain_c1.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))

from oracle import foresee  # noqa: E402
from run import cell_engine, cell_requests, one_cell  # noqa: E402

from sglang_adaflash.bench.machine import cpu_description  # noqa: E402


def predicted_seconds(cost, lengths: list[int]) -> float:
    """The cost model's price of a step verifying `lengths` (planner.lengths' module docstring)."""
    drafted = [n for n in lengths if n > 1]
    return (cost.fixed + (cost.draft_fixed if drafted else 0.0)
            + sum(cost.per_token * n - cost.per_proposal for n in lengths) + cost.per_draft * len(drafted))


def _plain_steps(eng) -> dict[int, list[float]]:
    """Run `eng` (ar) and return its decode steps' measured seconds per batch size."""
    seconds: dict[int, list[float]] = collections.defaultdict(list)
    verify = eng._verify_step

    def timed(seqs, spec, t0, t1):
        verify(seqs, spec, t0, t1)
        seconds[len(seqs)].append(time.perf_counter() - t0)

    eng._verify_step = timed
    return seconds


def _foresight_steps(eng, tables: dict[str, list[int]]) -> list[dict]:
    """Wrap an adaflash engine's verify so every step records foreseen against realised, and
    per row (drafted, verified slots, accepted, what the oracle's table says it would accept)."""
    steps: list[dict] = []
    verify, block = eng._verify_step, eng.block_size

    def traced(seqs, spec, t0, t1):
        bs = len(seqs)
        cost = eng._cost(bs)  # the model the step's plan read: no fit is updated before the verify
        lengths = spec.lengths.tolist()
        ratios = spec.predicted_ratios(block, True)
        before = eng.stats.committed_tokens
        drafted = set(spec.drafted)
        rows = [[int(i in drafted), lengths[i], len(s.output), tables[s.req.request_id][len(s.output)],
                 min(block, s.remaining)] for i, s in enumerate(seqs)]
        verify(seqs, spec, t0, t1)
        for row, s in zip(rows, seqs):
            row[2] = len(s.output) - row[2] - 1  # accepted (a stop token may cut it short)
        steps.append({"rows": rows,
            "bs": bs, "drafted": len(spec.drafted), "forced": len(spec.probes),
            "verified": sum(lengths),
            "tokens_foreseen": round(sum(r * block for r in ratios), 4),
            "tokens": eng.stats.committed_tokens - before,
            "seconds_foreseen": predicted_seconds(cost, lengths),
            "plain_foreseen": cost.plain_step(bs),
            "seconds": time.perf_counter() - t0,
            "draft_seconds": spec.draft_seconds,
        })

    eng._verify_step = traced
    return steps


def summarise(steps: list[dict], plain: dict[int, list[float]]) -> list[dict]:
    """Per (batch size, drafted or plain, forced only or planned): means and speedups."""
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for s in steps:
        kind = "plain" if not s["drafted"] else ("forced" if s["drafted"] == s["forced"] else "planned")
        groups[(s["bs"], kind)].append(s)
    rows = []
    for (bs, kind), group in sorted(groups.items()):
        def mean(key, group=group):
            return statistics.fmean(s[key] for s in group)

        ar_step = statistics.median(plain[bs]) if plain.get(bs) else None
        row = {"bs": bs, "kind": kind, "steps": len(group),
               "tokens_foreseen": mean("tokens_foreseen"), "tokens": mean("tokens"),
               "ms_foreseen": 1e3 * mean("seconds_foreseen"), "ms": 1e3 * mean("seconds"),
               "plain_ms_foreseen": 1e3 * mean("plain_foreseen"),
               "ar_ms": None if ar_step is None else 1e3 * ar_step,
               "draft_ms": 1e3 * mean("draft_seconds")}
        # speedup over a plain step: foreseen by the cost model, realised against ar's own steps
        row["gain_foreseen"] = (row["tokens_foreseen"] / row["ms_foreseen"]) / (bs / row["plain_ms_foreseen"])
        row["gain"] = None if ar_step is None else (row["tokens"] / row["ms"]) / (bs / row["ar_ms"])
        rows.append(row)
    return rows


def decisions(steps: list[dict]) -> dict:
    """The rule's draft-or-not decisions against the oracle's table, over all row-steps."""
    plain = [r for s in steps for r in s["rows"] if not r[0] and r[4] > 1]
    drafted = [r for s in steps for r in s["rows"] if r[0]]

    def share(rows, test):
        return sum(1 for r in rows if test(r)) / max(len(rows), 1)

    return {
        "plain_row_steps": len(plain),
        "plain_would_accept_share": share(plain, lambda r: r[3] > 0),
        "plain_would_accept_mean": statistics.fmean(r[3] for r in plain) if plain else None,
        "drafted_row_steps": len(drafted),
        "drafted_verified_mean": statistics.fmean(r[1] for r in drafted) if drafted else None,
        "drafted_accepted_mean": statistics.fmean(r[2] for r in drafted) if drafted else None,
        "drafted_block_would_accept_mean": statistics.fmean(min(r[3], r[4] - 1) for r in drafted) if drafted else None,
        "drafted_accepting_nothing_share": share(drafted, lambda r: r[2] == 0),
        "drafted_cut_short_share": share(drafted, lambda r: r[3] > r[1] - 1 and r[1] < r[4]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--workload", default="in_domain", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--repeats", type=int, default=2, help="ar/adaflash pairs; the steps of all are pooled")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    c = args.concurrency
    pair, prompts, n, max_seq = one_cell(args.workload, c)
    plain: dict[int, list[float]] = collections.defaultdict(list)
    steps: list[dict] = []
    totals = collections.defaultdict(list)
    tables: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for mode in ("ar", "adaflash"):
            eng = cell_engine(pair, mode, c, prompts, n, max_seq)
            got = _plain_steps(eng) if mode == "ar" else None
            traced = _foresight_steps(eng, tables) if mode == "adaflash" else None
            t0 = time.perf_counter()
            outs = eng.run(cell_requests(prompts, n, 64, tuple(pair.stop_token_ids)))
            totals[mode].append(sum(len(o.output_ids) for o in outs) / (time.perf_counter() - t0))
            if got is not None:
                for bs, secs in got.items():
                    plain[bs].extend(secs)
                if not tables:  # at T=0 every mode commits these outputs (run.py checks it)
                    by_prompt: dict[tuple, list[int]] = {}
                    for o in outs:
                        key = tuple(o.prompt_ids)
                        if key not in by_prompt:
                            by_prompt[key] = foresee(pair, o.prompt_ids, o.output_ids, block_size=eng.block_size)
                        tables[o.request_id] = by_prompt[key]
            else:
                steps.extend(traced)
    rows = summarise(steps, plain)
    verdicts = decisions(steps)
    print(f"{args.workload} c={c}: ar {statistics.median(totals['ar']):.1f} tok/s, "
          f"adaflash {statistics.median(totals['adaflash']):.1f} tok/s")
    print(f"{'bs':>3} {'kind':>7} {'steps':>5} {'tok fore':>8} {'tok':>6} {'ms fore':>7} {'ms':>6} "
          f"{'plain fore':>10} {'ar ms':>6} {'gain fore':>9} {'gain':>6}")
    for r in rows:
        ar_ms = "-" if r["ar_ms"] is None else f"{r['ar_ms']:.2f}"
        gain = "-" if r["gain"] is None else f"{r['gain']:.3f}"
        print(f"{r['bs']:>3} {r['kind']:>7} {r['steps']:>5} {r['tokens_foreseen']:>8.2f} {r['tokens']:>6.2f} "
              f"{r['ms_foreseen']:>7.2f} {r['ms']:>6.2f} {r['plain_ms_foreseen']:>10.2f} {ar_ms:>6} "
              f"{r['gain_foreseen']:>9.3f} {gain:>6}")
    print("decisions against the oracle's table:", {k: round(v, 3) if isinstance(v, float) else v
                                                    for k, v in verdicts.items()})
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": " ".join(["benchmarks/adaptive/foresight.py", *sys.argv[1:]]),
            "environment": {"cpu": cpu_description()},
            "tok_s": {m: v for m, v in totals.items()}, "rows": rows, "decisions": verdicts,
            "steps": steps}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
