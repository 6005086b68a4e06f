"""What a drafter step costs as its MLP widens (the issue's budget: at most 1.2x today's step).

    python benchmarks/drafter_recipe/width_cost.py --widths 768,1024,1536,2048 \
        --out benchmarks/drafter_recipe/stage2/width_cost.json

One DFlash drafter layer at the shipped target's sizes and layer ids (`training_job.step_timing`'s
`drafter_step`: random weights, batch 1, one block of 16 over ``--context`` cached context
features, plus the target's LM head over the block and the argmax). The widths run interleaved, one step each in turn, so a
busy moment of the shared machine hits all of them alike; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from training_job.data.common import atomic_write_text  # noqa: E402
from training_job.step_timing import drafter_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("sglang_adaflash/assets/models/target"))
    ap.add_argument("--widths", default="768,1024,1536")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    widths = [int(w) for w in args.widths.split(",")]
    steps = {w: drafter_step(target, 1, args.context, args.block, intermediate_size=w, layer_ids=[1, 3, 4])
             for w in widths}
    for s in steps.values():
        for _ in range(20):
            s()
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(args.repeats):
        for w, s in steps.items():
            t = time.perf_counter()
            s()
            times[w].append(time.perf_counter() - t)
    ms = {w: 1000 * statistics.median(v) for w, v in times.items()}
    base = ms[widths[0]]
    out = {"command": "python " + " ".join(["benchmarks/drafter_recipe/width_cost.py"] + sys.argv[1:]),
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "target")},
           "step_ms": {str(w): round(v, 3) for w, v in ms.items()},
           "over_first": {str(w): round(v / base, 3) for w, v in ms.items()}}
    print(json.dumps(out["step_ms"]), json.dumps(out["over_first"]))
    atomic_write_text(args.out, json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
