"""What drafting costs the target's verify beyond its tokens: one verify forward at a batch size,
timed by how many rows verify several slots (the rest one), on the embedded pair.

On a CPU a batch with a multi-token row leaves the one padded attention call of a plain step for
the target's ragged path, unless every row has the same length; the online cost model's
"anyone drafted" and per-drafted-row terms (sglang_adaflash/planner/cost.py) are this shape.

    python benchmarks/adaptive/verify_shape.py --batch 8 --slots 4 --out benchmarks/adaptive/verify_shape.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.target.hf_target import TargetBatch  # noqa: E402


def measure(target, bs: int, slots: int, context: int, repeats: int) -> dict[int, float]:
    cache = target.new_cache(bs, context + slots + 1)
    with torch.inference_mode():
        target.forward(TargetBatch.from_lists([[5] * context] * bs, [0] * bs), cache,
                       logits_rows=torch.arange(bs) * context + context - 1)
        times: dict[int, list[float]] = {}
        for rep in range(repeats + 1):  # the first round is untimed (first kernels at these shapes)
            for k in sorted({0, 1, 2, bs // 2, bs}):
                batch = TargetBatch.from_lists([[7] * (slots if i < k else 1) for i in range(bs)], [context] * bs)
                t0 = time.perf_counter()
                target.forward(batch, cache)
                if rep:
                    times.setdefault(k, []).append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = load_pair(TARGET_DIR, str(DRAFTER_DIR), dtype="float32").target
    rows = []
    for bs in args.batch:
        med = measure(target, bs, args.slots, args.context, args.repeats)
        for k, t in med.items():
            extra = (t - med[0]) / k if k else 0.0
            rows.append({"batch": bs, "drafted_rows": k, "slots": args.slots, "ms": round(t * 1e3, 3),
                         "extra_ms_per_drafted_row": round(extra * 1e3, 3)})
            print(f"batch {bs:3d}  rows verifying {args.slots} slots {k:3d}: {t * 1e3:7.2f} ms"
                  f"  (+{extra * 1e3:.2f} ms a drafted row over plain)")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["benchmarks/adaptive/verify_shape.py", *sys.argv[1:]]),
                                              "context": args.context, "threads": 1, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
