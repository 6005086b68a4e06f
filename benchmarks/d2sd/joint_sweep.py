"""`--branch-drafter joint` at c=1: tree settings side by side with dflash and the first drafter's tree.

Serves the 16 in-domain prompts of prompts16.jsonl one request at a time (float32, one torch
thread) with dflash, the one-drafter tree (`first`, tree-k 4, width 4) and joint trees of
several sizes under the load-aware rule, with the shipped recovery drafter and with the one
that shares the first drafter's context modules (`embedded-shared`), interleaved over
--repeats rounds so that a slow spell of the shared machine hits every engine of a round.
Each figure is the median over the rounds of the ratio to the same round's dflash.
`--price-scale` also runs the default joint tree with the plan's verify-token price scaled
(0.5 = tokens priced at half their measured cost), which shows how flat the plan's objective
is around its choice. Every output is checked
against `ar`'s, token for token.

    python benchmarks/d2sd/joint_sweep.py --out benchmarks/d2sd/joint_sweep.json

`--trees` picks the rows (by name, comma-separated) instead of the default set.
`--recovery NAME=DIR` (repeatable) adds a row "joint-NAME k3 w3 l2" serving the recovery drafter
in DIR with the recommended joint tree, to compare a retrained one with the shipped ones in the
same rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.runner import BenchConfig, build_workload  # noqa: E402
from sglang_adaflash.d2sd.cli import RECOVERY_DIR, RECOVERY_SHARED_DIR  # noqa: E402
from sglang_adaflash.d2sd.engine import D2SDEngine  # noqa: E402
from sglang_adaflash.d2sd.recovery_drafter import load_recovery_drafter  # noqa: E402
from sglang_adaflash.engine.engine import EngineStats  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.engine_factory import make_engine  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.launch.prompts import read_prompts  # noqa: E402

PROMPTS = ROOT / "benchmarks" / "d2sd" / "prompts16.jsonl"
# name: (branch drafter, tree-k, branch-width, branch-len, recovery drafter)
TREES = {
    "first k4 w4": ("first", 4, 4, 1, None),
    "joint k4 w4 l4": ("joint", 4, 4, 4, "embedded"),
    "joint k2 w4 l2": ("joint", 2, 4, 2, "embedded"),
    "joint k3 w3 l2": ("joint", 3, 3, 2, "embedded"),
    "joint k1 w4 l2": ("joint", 1, 4, 2, "embedded"),
    # the recovery drafter that shares the first drafter's context modules (one context cache)
    "joint-shared k4 w4 l4": ("joint", 4, 4, 4, "embedded-shared"),
    "joint-shared k2 w4 l2": ("joint", 2, 4, 2, "embedded-shared"),
    "joint-shared k3 w3 l2": ("joint", 3, 3, 2, "embedded-shared"),
    "joint-shared k3 w4 l2": ("joint", 3, 4, 2, "embedded-shared"),
    "joint-shared k4 w4 l3": ("joint", 4, 4, 3, "embedded-shared"),
}
# the rows a plain run sweeps (the two above them only with --trees)
DEFAULT_TREES = [name for name in TREES if name not in ("joint-shared k3 w4 l2", "joint-shared k4 w4 l3")]


class ScaledPrice(D2SDEngine):
    """The plan sees verify tokens at `scale` times their measured price (the sweep's probe of
    the objective's flatness; not an engine option)."""

    scale = 1.0

    def _tree_cost_model(self, bs, rows):
        cost = super()._tree_cost_model(bs, rows)
        return replace(cost, per_token=cost.per_token * self.scale)


def _portable(path: Path) -> str:
    """A --recovery directory as the command records it: relative to the repository when inside it,
    as given when relative, else its name alone (no machine paths)."""
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--price-scale", type=float, nargs="*", default=[0.5, 1.5])
    ap.add_argument("--trees", default=",".join(DEFAULT_TREES),
                    help=f"comma-separated rows to sweep beside ar and dflash, of: {', '.join(TREES)}")
    ap.add_argument("--recovery", action="append", default=[], metavar="NAME=DIR",
                    help="also a joint k3 w3 l2 row with the recovery drafter in DIR")
    args = ap.parse_args(argv)
    trees = [t.strip() for t in args.trees.split(",") if t.strip()]
    if unknown := [t for t in trees if t not in TREES]:
        ap.error(f"unknown trees {unknown}; known: {', '.join(TREES)}")
    extra = {}
    for spec in args.recovery:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where:
            ap.error(f"--recovery wants NAME=DIR, got {spec!r}")
        if name in ("embedded", "embedded-shared") or name in extra or f"joint-{name} k3 w3 l2" in TREES:
            ap.error(f"--recovery name {name!r} is taken (by a shipped drafter, a built-in row or an earlier "
                     "--recovery): choose another")
        extra[name] = Path(where)
    torch.set_num_threads(1)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    recovery = load_recovery_drafter(RECOVERY_DIR, pair.drafter)
    recoveries = {"embedded": recovery, "embedded-shared": load_recovery_drafter(RECOVERY_SHARED_DIR, pair.drafter),
                  None: None}
    for name, where in extra.items():
        recoveries[name] = load_recovery_drafter(where, pair.drafter)
    all_trees = {**TREES, **{f"joint-{name} k3 w3 l2": ("joint", 3, 3, 2, name) for name in extra}}
    trees += [f"joint-{name} k3 w3 l2" for name in extra]
    cfg = BenchConfig(target=str(TARGET_DIR), drafter=str(DRAFTER_DIR), prompts=[], max_new_tokens=64)
    wl = build_workload(read_prompts([str(PROMPTS)]), pair, cfg, 16)
    engines = {"ar": make_engine(pair, "ar", 1, 600, 0, num_requests=16),
               "dflash": make_engine(pair, "dflash", 1, 600, 0, num_requests=16)}
    for name in trees:
        src, k, w, ln, rec = all_trees[name]
        engines[name] = D2SDEngine(pair.target, pair.drafter, recoveries[rec],
                                   branch_drafter=src, tree_k=k, branch_width=w, branch_len=ln,
                                   tree_rule="load_aware", max_batch_size=1, max_seq_len=600)
    for scale in args.price_scale:
        eng = ScaledPrice(pair.target, pair.drafter, recovery, branch_drafter="joint", tree_k=4, branch_width=4,
                          branch_len=4, tree_rule="load_aware", max_batch_size=1, max_seq_len=600)
        eng.scale = scale
        engines[f"joint k4 w4 l4, price x{scale}"] = eng
    reference = [o.output_ids for o in engines["ar"].run(wl.requests(16, pair.stop_token_ids))]
    for eng in engines.values():
        eng.run(wl.requests(16, pair.stop_token_ids)[:4])  # warm-up, and the cost models' first fit
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    equal = True
    for _ in range(args.repeats):
        for name, eng in engines.items():
            eng.stats = EngineStats()
            t0 = time.perf_counter()
            outs = eng.run(wl.requests(16, pair.stop_token_ids))
            wall = time.perf_counter() - t0
            equal &= [o.output_ids for o in outs] == reference
            s = eng.stats
            rounds[name].append({"tokens_per_s": s.committed_tokens / wall, "tau": s.committed_tokens / s.steps,
                                 "verified_per_step": s.verified_tokens / s.steps})
    results = {}
    for name, rs in rounds.items():
        ratio = [r["tokens_per_s"] / d["tokens_per_s"] for r, d in zip(rs, rounds["dflash"])]
        results[name] = {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
            "tau": round(statistics.median(r["tau"] for r in rs), 3),
            "verified_per_step": round(statistics.median(r["verified_per_step"] for r in rs), 2),
            "vs_dflash_tau": round(statistics.median(r["tau"] / d["tau"] for r, d in zip(rs, rounds["dflash"])), 3),
            "vs_dflash_tokens_per_s": round(statistics.median(ratio), 3),
            "vs_dflash_tokens_per_s_rounds": [round(x, 3) for x in ratio],
        }
    scales = "" if args.price_scale == [0.5, 1.5] else " ".join([" --price-scale", *map(str, args.price_scale)])
    repeats = "" if args.repeats == 3 else f" --repeats {args.repeats}"
    chosen = "" if trees == DEFAULT_TREES + [f"joint-{n} k3 w3 l2" for n in extra] else \
        f" --trees '{','.join(t for t in trees if t in TREES)}'"
    chosen += "".join(f" --recovery {name}={_portable(where)}" for name, where in extra.items())
    report = {"command": f"python benchmarks/d2sd/joint_sweep.py{scales}{repeats}{chosen} --out {args.out}",
              "settings": {"dtype": "float32", "threads": 1, "concurrency": 1, "requests": 16, "max_new_tokens": 64,
                           "repeats": args.repeats, "tree_rule": "load_aware"},
              "equal_to_ar": equal, "results": results}
    write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(f"{name:32s} tau x{r['vs_dflash_tau']:.3f}  tok/s x{r['vs_dflash_tokens_per_s']:.3f} "
              f"{r['vs_dflash_tokens_per_s_rounds']}  verified/step {r['verified_per_step']}")
    print("equal to ar:", equal)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
