"""The width lever, measured on top of the second stage: the refined drafter's MLP grown to a wider
one that computes the same function (new units' down-projection columns start at zero;
`training_job.dflash_offline.warm_start`), then trained like a second stage again on a third pass
of continuations.

    python benchmarks/drafter_recipe/widen.py --out runs/models --width 1536

Needs `python -m training_job.models build --out runs/models --stages refine` first (its
drafter_refined/ is the start, its drafter_work/ the data). Writes runs/models/drafter_wide/ (and
drafter_wide_work/: checkpoints, resumable). Not part of `make models`: at 1536 it costs 1.19x the
shipped drafter's step and did not raise code's tau (benchmarks/drafter_recipe/README.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from training_job import models  # noqa: E402
from training_job.dflash_offline import DrafterTrainConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the build directory of training_job.models")
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args(argv)
    base = args.out / "drafter_refined"
    if not (base / "manifest.json").exists():
        raise SystemExit(f"{base} is missing: run `python -m training_job.models build --out {args.out} "
                         "--stages refine` first")
    cfg = replace(DrafterTrainConfig().refined(base, max_steps=args.steps), intermediate_size=args.width,
                  continuation_passes=3, seed=DrafterTrainConfig().seed + 2)
    models.stage_drafter(args.out, args.out / "data", args.out / "target", cfg, name="drafter_wide")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
