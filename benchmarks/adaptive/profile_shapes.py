"""What a verified token costs the target at the shapes a verify has, against the slope of
prefill-sized forwards: the start-up price the load-aware rule begins from (engine.sizing).

One request over a cached context, verifying q = 1..B tokens, each shape's forward timed in
interleaved rounds (so a drift of the machine's speed falls on every shape alike), medians over
the rounds. Beside it the slope between a 16- and a 128-token prefill, which the start-up
profile priced a verified token by before, and the profile as it is now
(`profile_step_cost`, several times: it is what one engine starts from).

    python benchmarks/adaptive/profile_shapes.py --out benchmarks/adaptive/profile_shapes/results_xeon.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.alternating import round_robin_medians  # noqa: E402
from sglang_adaflash.bench.machine import cpu_description  # noqa: E402
from sglang_adaflash.engine.engine import SpecEngine  # noqa: E402
from sglang_adaflash.engine.sizing import profile_step_cost  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.target.hf_target import TargetBatch  # noqa: E402


def forward_medians(target, cache, batches: dict, rounds: int) -> dict:
    """Median ms of each batch's forward, one forward of each per round (bench.alternating)."""
    fns = {k: (lambda b=b: target.forward(b, cache)) for k, b in batches.items()}
    return {k: 1e3 * v for k, v in round_robin_medians(fns, rounds).items()}


def slope(ms: dict, lo: int, hi: int) -> float:
    return (ms[hi] - ms[lo]) / (hi - lo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="64,150")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--profiles", type=int, default=5, help="profile_step_cost runs (one engine starts from one)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    target = pair.target
    block = pair.drafter.config.block_size
    # the engine's constructor sets the target to capture the features adaflash's forwards capture
    engine = SpecEngine(target, pair.drafter, mode="adaflash", max_batch_size=1, max_seq_len=400)
    out = {"command": "benchmarks/adaptive/profile_shapes.py " + " ".join(argv or sys.argv[1:]),
           "machine": cpu_description(), "threads": args.threads, "rounds": args.rounds, "verify": []}
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            cache = target.new_cache(1, context + block + 1)
            ids = torch.randint(10, target.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
            target.forward(TargetBatch(ids, torch.zeros(1, dtype=torch.long), torch.tensor([context])), cache)
            batches = {q: TargetBatch(ids[:, :q], torch.tensor([context]), torch.tensor([q])) for q in range(1, block + 1)}
            ms = forward_medians(target, cache, batches, args.rounds)
            out["verify"].append({
                "context": context,
                "forward_ms": {str(q): round(v, 3) for q, v in ms.items()},
                "slope_2_to_9_ms": round(slope(ms, 2, 9), 4),
                "slope_2_to_block_ms": round(slope(ms, 2, block), 4),
                "step_1_to_2_ms": round(ms[2] - ms[1], 3),
            })
        cache = target.new_cache(1, 129)
        zeros = torch.zeros(1, 128, dtype=torch.long)
        pre = {n: TargetBatch(zeros[:, :n], torch.zeros(1, dtype=torch.long), torch.tensor([n])) for n in (16, 128)}
        ms = forward_medians(target, cache, pre, max(args.rounds // 4, 5))
        out["prefill_16_to_128"] = {"forward_ms": {str(n): round(v, 3) for n, v in ms.items()},
                                    "slope_ms": round(slope(ms, 16, 128), 4)}
    profiles = [profile_step_cost(engine) for _ in range(args.profiles)]
    out["profile_step_cost"] = [{"fixed_ms": round(p.fixed * 1e3, 3), "per_token_ms": round(p.per_token * 1e3, 4),
                                 "draft_fixed_ms": round(p.draft_fixed * 1e3, 3)} for p in profiles]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.out), text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
