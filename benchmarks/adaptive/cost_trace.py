"""What the load-aware rule sees, step by step, in one cell of the adaptive benchmark.

Builds the engine as run.py does (a two-request warm-up, then a cold calibration state) and
prints, for every decode step that plans, the cost model the plan read (ms), the first rows'
posterior rates and per-position rates, their planned lengths and how many rows were planned to
draft. The traces quoted in this folder's README (in-domain c=16 and c=32) are of this script.

    python benchmarks/adaptive/cost_trace.py --concurrency 16 --workload in_domain --every 15
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))

from run import cell_engine, cell_requests, one_cell  # noqa: E402

from sglang_adaflash.engine.draft_choice import DraftChoice  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--workload", default="in_domain", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--every", type=int, default=15, help="print the first 12 plans, then every N-th")
    args = ap.parse_args(argv)
    c = args.concurrency
    pair, prompts, n, max_seq = one_cell(args.workload, c)

    def requests():
        return cell_requests(prompts, n, 64, tuple(pair.stop_token_ids))

    engine = cell_engine(pair, "adaflash", c, prompts, n, max_seq)  # warm, then cold calibration, as run.py
    plan = DraftChoice._plan_on_host if engine.choice.host else DraftChoice._plan_on_device
    step = [0]

    def traced(self, bs, caps, cost):
        rate, draw, force, lens = plan(self, bs, caps, cost)
        step[0] += 1
        if step[0] <= 12 or step[0] % args.every == 0:
            per_slot = self.posterior.per_slot(torch.arange(bs), torch.as_tensor(draw), 4)
            ms = {k: round(v * 1e3, 3) for k, v in vars(cost).items()}
            print(f"plan {step[0]} bs {bs} cost(ms) {ms} rate {np.round(np.asarray(rate)[:4], 2)} "
                  f"per-position(row 0) {np.round(per_slot[0].numpy(), 2)} lengths {np.asarray(lens)[:8]} "
                  f"forced {int(np.asarray(force).sum())} planned {int((np.asarray(lens) > 1).sum())}")
        return rate, draw, force, lens

    setattr(DraftChoice, "_plan_on_host" if engine.choice.host else "_plan_on_device", traced)
    outs = engine.run(requests())
    drafted = sum(sum(o.stats.drafted) for o in outs)
    steps = sum(o.stats.steps for o in outs)
    print(f"drafted share {drafted / steps:.2f} over {steps} request-steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
