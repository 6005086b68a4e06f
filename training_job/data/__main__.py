"""``python -m training_job.data build --out DIR [--toy]``: rebuild every workload."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import DataConfig, build_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training_job.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the code, math and prose splits")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--toy", action="store_true", help="a few records per domain, for tests")
    b.add_argument("--seed", type=int, default=DataConfig.seed)
    args = ap.parse_args(argv)
    cfg = DataConfig.toy() if args.toy else DataConfig()
    if args.seed != cfg.seed:
        from dataclasses import replace

        cfg = replace(cfg, seed=args.seed)
    manifest = build_all(args.out, cfg)
    for name, n in sorted(manifest["counts"].items()):
        print(f"{name:24s} {n:7d} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
