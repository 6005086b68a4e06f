"""The ceiling of adaptive verification on this machine: an oracle that knows every draft's fate.

Issue 12 asks `adaflash` to beat max(`ar`, `dflash`) by 1.15x on the mixed workload at c >= 8.
Whether any verify-length rule can do that here is a question about the pair and the machine,
not about the rule, so this script measures it. The oracle is a SpecEngine whose drafting step
knows, before it pays for anything, how many of each request's proposals the target will accept.
At T=0 every run commits `ar`'s tokens, so that number is a table per prompt (`foresee`), made
before the timed runs: for each committed length m, the drafter's leading proposals that equal
the target's next tokens. Every step the oracle

- drafts only the rows whose next draft will accept at least a_min proposals, and only the
  block slots it will verify (the proposer's `read`: the same proposals as the whole block, for
  the query side of those slots alone), after catching their drafter context up;
- verifies exactly those proposals plus the bonus token of the drafted rows, and the bonus token
  alone of every other row, so (up to float rounding between batch layouts, which the results
  count as `foreseen_accepted`) no verified proposal is rejected.

The oracle pays no length head, no planner, no probes and no rejected slot; a real rule pays at
least what it pays for the same tokens, and the trivial policy of never drafting is `ar` itself.
So no verify-length policy with this drafter, target and engine beats max(`ar`, best oracle)
here, and where that stays below a goal, no rule can meet it on this machine. Each run's output
is checked token for token against `ar`'s.

    .venv/bin/python benchmarks/adaptive/bound.py --out benchmarks/adaptive/bound/results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_adaflash.assets import MODELS_DIR
from sglang_adaflash.bench.runner import recorded_path
from sglang_adaflash.engine.engine import EngineStats
from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.engine_factory import make_engine
from sglang_adaflash.launch.loading import load_pair
from sglang_adaflash.launch.prompts import resolve_prompt_ids


def _load(name: str, module_name: str):
    """A script beside this file, by path and under its own name (a bare `import run` would take
    whichever `run` module a process loaded first)."""
    spec = importlib.util.spec_from_file_location(module_name, Path(__file__).resolve().with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RUN = _load("run.py", "adaptive_run")
cell_requests, workloads = _RUN.cell_requests, _RUN.workloads  # the same workloads and requests
_ORACLE = _load("oracle.py", "adaptive_oracle")
foresee, OracleEngine = _ORACLE.foresee, _ORACLE.OracleEngine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--workloads", default="in_domain,math,mixed")
    ap.add_argument("--a-min", default="1,2", help="oracles to run: the fewest accepted proposals worth a draft")
    ap.add_argument("--no-adaflash", action="store_true", help="leave the real adaflash out of the run")
    ap.add_argument("--per-domain", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    conc = [int(c) for c in args.concurrency.split(",")]
    a_mins = [int(a) for a in args.a_min.split(",")]
    pair = load_pair(MODELS_DIR / "target", MODELS_DIR / "drafter", dtype="float32")
    block = pair.drafter.config.block_size
    stop = tuple(pair.stop_token_ids)
    loads = workloads(args.per_domain)
    rows, equality_ok = [], True
    for wname in args.workloads.split(","):
        prompts = [(resolve_prompt_ids(s, pair.tokenizer), s.domain) for s in loads[wname]]
        max_seq = max(len(p) for p, _ in prompts) + args.max_new_tokens
        for c in conc:
            n = max(args.waves * c, len(prompts))

            def requests(prompts=prompts, n=n):
                return cell_requests(prompts, n, args.max_new_tokens, stop)

            ar = make_engine(pair, "ar", c, max_seq, 0, num_requests=n)
            reference = {o.request_id: o.output_ids for o in ar.run(requests())}  # also ar's warm-up
            tables: dict[tuple, list[int]] = {}
            accepted = {}
            for r in requests():
                key = tuple(r.prompt_ids)
                if key not in tables:
                    tables[key] = foresee(pair, r.prompt_ids, reference[r.request_id], block_size=block)
                accepted[r.request_id] = tables[key]
            engines = {"ar": ar}
            if not args.no_adaflash:
                engines["adaflash"] = make_engine(pair, "adaflash", c, max_seq, 0, num_requests=n)
            for a in a_mins:
                engines[f"oracle_a{a}"] = OracleEngine(pair.target, pair.drafter, max_batch_size=min(c, n),
                                                       max_seq_len=max_seq, seed=0, accepted=accepted, a_min=a)
            for name, e in engines.items():
                if name != "ar":
                    e.run(requests()[: min(2, n)])  # warm-up (adaflash: its cost profile)
            tput = {m: [] for m in engines}
            stats, checks = {}, {}
            for rep in range(args.repeats):
                order = list(engines)[rep % len(engines):] + list(engines)[: rep % len(engines)]
                for m in order:
                    e = engines[m]
                    e.stats = EngineStats()
                    if isinstance(e, OracleEngine):
                        e.foreseen = 0
                    t0 = time.perf_counter()
                    outs = e.run(requests())
                    wall = time.perf_counter() - t0
                    done = sum(len(o.output_ids) for o in outs)
                    tput[m].append(done / wall)
                    if any(o.output_ids != reference[o.request_id] for o in outs):
                        equality_ok = False
                        print(f"T=0 MISMATCH: {wname} c={c} {m} repeat {rep}", file=sys.stderr)
                    steps = sum(o.stats.steps for o in outs)
                    n_accepted = sum(o.stats.committed_tokens for o in outs) - steps
                    drafted = sum(1 for o in outs for v in o.stats.verify_lens if v > 1)
                    stats[m] = {"tau": (n_accepted + steps) / steps, "drafted_share": drafted / steps}
                    if isinstance(e, OracleEngine):  # every repeat's (foreseen, accepted): rounding
                        checks.setdefault(m, []).append([e.foreseen, n_accepted])  # could part them
                        stats[m]["foreseen_accepted"] = checks[m]
            med = {m: statistics.median(v) for m, v in tput.items()}
            for m in engines:
                rows.append({"workload": wname, "concurrency": c, "mode": m, "requests": n,
                             "throughput_tok_s": med[m], "samples": tput[m], "vs_ar": med[m] / med["ar"],
                             **stats[m]})
            print(f"{wname:9s} c={c:2d}  ar {med['ar']:7.1f} tok/s  "
                  + "  ".join(f"{m} {med[m] / med['ar']:.3f}x (tau {stats[m]['tau']:.2f})" for m in engines if m != "ar"),
                  flush=True)
    best = {}
    for r in rows:
        if r["mode"].startswith("oracle"):
            key = (r["workload"], r["concurrency"])
            best[key] = max(best.get(key, 0.0), r["vs_ar"])
    out = {
        "command": " ".join(["benchmarks/adaptive/bound.py", *[recorded_path(a) for a in (argv or sys.argv[1:])]]),
        "settings": vars(args) | {"out": recorded_path(args.out), "dtype": "float32", "temperature": 0.0},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "processor": platform.machine()},
        "equality_ok": equality_ok,
        "best_oracle_vs_ar": [{"workload": w, "concurrency": c, "vs_ar": v} for (w, c), v in best.items()],
        "rows": rows,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(out, indent=1) + "\n")
    return 0 if equality_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
