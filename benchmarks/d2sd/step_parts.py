"""Where a c=1 decode step's time goes, by wall-clock timers instead of a profiler.

cProfile (micro.py) inflates the Python-heavy parts of a tree step several times over; this
wraps the step's parts in perf_counter timers only (a few microseconds each) and serves the 16
in-domain prompts of prompts16.jsonl at c=1 with dflash and with d2sd's three branch sources
(tree-k 4, branch-len 4, width 4, load-aware), the modes interleaved over --repeats rounds;
each figure is the median over the rounds, a ratio to dflash the median of the
ratios within each round.

    python benchmarks/d2sd/step_parts.py --out benchmarks/d2sd/step_parts.json
    python benchmarks/d2sd/step_parts.py --sources first,joint --out benchmarks/d2sd/step_parts_joint.json
    python benchmarks/d2sd/step_parts.py --sources joint --recovery-drafter embedded-shared \
        --tree-k 3 --branch-width 3 --branch-len 2 --out benchmarks/d2sd/step_parts_shared.json

--sources picks the d2sd branch sources timed beside dflash (default: first, auto, recovery);
--recovery-drafter, --tree-k, --branch-width and --branch-len the tree (default: the shipped
`embedded` recovery drafter, 4, 4 and 4).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.runner import BenchConfig, build_workload  # noqa: E402
from sglang_adaflash.d2sd import engine as d2sd_engine  # noqa: E402
from sglang_adaflash.d2sd.cli import RECOVERY_DIR, RECOVERY_SHARED_DIR  # noqa: E402
from sglang_adaflash.d2sd.recovery_drafter import TreeProposer, load_recovery_drafter  # noqa: E402
from sglang_adaflash.engine.engine import EngineStats, SpecEngine  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.engine_factory import make_engine  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.launch.prompts import read_prompts  # noqa: E402

PROMPTS = ROOT / "benchmarks" / "d2sd" / "prompts16.jsonl"
# (owner, attribute): the parts timed. Nested parts are inside their callers' times.
PARTS = [
    (SpecEngine, "_decode_step"),
    (SpecEngine, "_draft"),
    (SpecEngine, "_update_context"),
    (d2sd_engine.D2SDEngine, "_decode_step"),
    (d2sd_engine.D2SDEngine, "_chain_logits"),
    (d2sd_engine.D2SDEngine, "_branches"),
    (d2sd_engine.D2SDEngine, "_first_drafter_branches"),
    (d2sd_engine.D2SDEngine, "_walk"),
    (d2sd_engine.D2SDEngine, "_joint_logits"),
    (d2sd_engine.D2SDEngine, "_joint_branches"),
    (d2sd_engine.D2SDEngine, "_draft_trees"),
    (d2sd_engine.D2SDEngine, "_read_chain"),
    (d2sd_engine.D2SDEngine, "_plan"),
    (d2sd_engine.D2SDEngine, "_observe_chain"),
    (TreeProposer, "extend_context"),
    (TreeProposer, "propose_joint"),
    (TreeProposer, "catch_up"),
    (TreeProposer, "propose_branches"),
    (d2sd_engine, "tree_forward"),
    (d2sd_engine, "plan_tree"),
    (d2sd_engine, "commit_paths"),
    (d2sd_engine, "flatten"),
]


def _instrument(totals: dict) -> None:
    for owner, name in PARTS:
        fn = getattr(owner, name)
        label = f"dflash{name}" if owner is SpecEngine else name

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sources", default="first,auto,recovery",
                    help="d2sd branch sources to time beside dflash (first, auto, recovery, joint)")
    ap.add_argument("--recovery-drafter", default="embedded", choices=["embedded", "embedded-shared"])
    ap.add_argument("--tree-k", type=int, default=4)
    ap.add_argument("--branch-width", type=int, default=4)
    ap.add_argument("--branch-len", type=int, default=4)
    args = ap.parse_args(argv)
    if args.recovery_drafter == "embedded-shared" and (deep := [s for s in args.sources.split(",")
                                                             if s in ("recovery", "auto")]):
        ap.error(f"--recovery-drafter embedded-shared is trained for the slot-1 branch alone (joint drafting); "
                 f"sources {deep} branch deeper: pass --sources joint (or first)")
    torch.set_num_threads(1)
    totals: dict[str, float] = defaultdict(float)
    _instrument(totals)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    recovery = load_recovery_drafter(RECOVERY_DIR if args.recovery_drafter == "embedded" else RECOVERY_SHARED_DIR,
                                     pair.drafter)
    cfg = BenchConfig(target=str(TARGET_DIR), drafter=str(DRAFTER_DIR), prompts=[], max_new_tokens=64)
    wl = build_workload(read_prompts([str(PROMPTS)]), pair, cfg, 16)
    tree = dict(tree_k=args.tree_k, branch_len=args.branch_len, branch_width=args.branch_width, tree_rule="load_aware",
                max_batch_size=1, max_seq_len=600)
    engines = {"dflash": make_engine(pair, "dflash", 1, 600, 0, num_requests=16)}
    for source in args.sources.split(","):
        kw = {**tree, "branch_len": 1} if source == "first" else tree
        engines[f"d2sd_{source}"] = d2sd_engine.D2SDEngine(pair.target, pair.drafter,
                                                            None if source == "first" else recovery,
                                                            branch_drafter=source, **kw)
    for eng in engines.values():
        eng.run(wl.requests(16, pair.stop_token_ids)[:4])  # warm-up, and the cost models' first fit
    runs: dict[str, list[dict]] = defaultdict(list)
    for _ in range(args.repeats):
        for name, eng in engines.items():
            totals.clear()
            eng.stats = EngineStats()
            t0 = time.perf_counter()
            eng.run(wl.requests(16, pair.stop_token_ids))
            wall = time.perf_counter() - t0
            steps = eng.stats.steps
            runs[name].append({"tokens_per_s": eng.stats.committed_tokens / wall,
                               "tau": eng.stats.committed_tokens / steps, "ms_per_step": wall / steps * 1e3,
                               **{f"{k}_ms": v / steps * 1e3 for k, v in totals.items()}})
    result = {name: {k: round(statistics.median(r[k] for r in rs if k in r), 3) for k in rs[0]}
              for name, rs in runs.items()}
    for name, r in result.items():  # ratios within each round (the machine drifts between rounds), then the median
        for key, field in (("vs_dflash_tokens_per_s", "tokens_per_s"), ("vs_dflash_tau", "tau")):
            per_round = [a[field] / b[field] for a, b in zip(runs[name], runs["dflash"])]
            r[key] = round(statistics.median(per_round), 3)
            r[key + "_rounds"] = [round(x, 3) for x in per_round]
    flags = "" if args.sources == "first,auto,recovery" else f" --sources {args.sources}"
    for flag, value, default in (("--recovery-drafter", args.recovery_drafter, "embedded"), ("--tree-k", args.tree_k, 4),
                                 ("--branch-width", args.branch_width, 4), ("--branch-len", args.branch_len, 4),
                                 ("--repeats", args.repeats, 5)):
        flags += f" {flag} {value}" if value != default else ""
    report = {"command": f"python benchmarks/d2sd/step_parts.py{flags} --out {args.out}",
              "settings": {"dtype": "float32", "threads": 1, "concurrency": 1, "requests": 16, "max_new_tokens": 64,
                           "repeats": args.repeats, "recovery_drafter": args.recovery_drafter,
                           "tree_k": args.tree_k, "branch_width": args.branch_width, "branch_len": args.branch_len},
              "results": result,
              "note": "ms per decode step, medians over the repeats; nested parts are inside their callers "
                      "(dflash_decode_step holds dflash_draft and dflash_update_context; propose_branches holds catch_up; _branches holds propose_branches and the LM head; "
                      "_draft_trees holds _chain_logits or _joint_logits (which holds propose_joint and the LM head), _read_chain, _plan (which holds plan_tree) and the branches; "
                      "ms_per_step includes prefill and admission, _decode_step does not)"}
    write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    for name, r in result.items():
        print(name, json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
