"""python -m sglang_adaflash.testing OUT_DIR [--preset NAME] [--seed S] [--workload N]

Writes a tiny random pair to OUT_DIR/{target,drafter} (reused when already built from the same
sizes and seed) and, with --workload N, a JSONL prompt file OUT_DIR/workload.jsonl.
"""

from __future__ import annotations

import argparse

from .tiny_pair import PRESETS, build_tiny_pair, write_tiny_workload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_adaflash.testing", description=__doc__.split("\n\n")[1])
    p.add_argument("out_dir")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default="float32")
    p.add_argument("--workload", type=int, default=0, metavar="N", help="also write N prompts to OUT_DIR/workload.jsonl")
    args = p.parse_args(argv)
    pair = build_tiny_pair(args.out_dir, seed=args.seed, dtype=args.dtype, **PRESETS[args.preset])
    print(f"target  {pair.target_dir}\ndrafter {pair.drafter_dir}")
    if args.workload:
        print(f"prompts {write_tiny_workload(pair.root / 'workload.jsonl', num_prompts=args.workload, seed=args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
