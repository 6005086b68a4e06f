"""`python -m adaflash_operator.retention`: prune the shared volume (the retention CronJob).

Run daily by the CronJob `<name>-retention` that the operator creates for every AdaFlashService
(spec.retention). It deletes

- traffic logs (any file under `traffic/`) last modified more than `--traffic-days` days ago:
  SGLang rotates its request log hourly, so only closed files are that old;
- drafter versions (`drafters/vNNNNNN/`) beyond the newest `--keep-versions`, except the fleet's
  (read from the mounted fleet ConfigMap when the Job starts), `drafters/latest`'s and every
  `--protect`ed one. A version is first renamed to a hidden `.deleting-` directory (readers skip
  hidden names) and then removed, so no reader sees a half-deleted version.

Standard library only: it runs in the serving image.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

VERSION_DIR = re.compile(r"^v([0-9]{6,})$")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def prune_traffic(home: Path, days: int, now: float) -> list[Path]:
    root = home / "traffic"
    cutoff = now - days * 86400
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for f in sorted(root.rglob("*")):
        if f.is_file() and not f.is_symlink() and f.stat().st_mtime < cutoff:
            f.unlink()
            removed.append(f)
    # A directory that held only old files goes too (a live pod's never does: it has a
    # current log); an empty one that held nothing is left to its writer.
    for d in sorted({f.parent for f in removed}, key=lambda p: len(p.parts), reverse=True):
        if d != root and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    return removed


def prune_versions(home: Path, keep: int, protect: set[str]) -> list[str]:
    drafters = home / "drafters"
    if not drafters.is_dir():
        return []
    versions = sorted((d.name for d in drafters.iterdir()
                       if d.is_dir() and VERSION_DIR.match(d.name)),
                      key=lambda v: int(VERSION_DIR.match(v).group(1)))  # type: ignore[union-attr]
    kept = set(versions[-keep:]) if keep > 0 else set()
    kept |= {v for v in protect if v}
    latest = _read(drafters / "latest")
    if latest:
        kept.add(Path(latest).name)
    removed = []
    for v in versions:
        if v in kept:
            continue
        doomed = drafters / f".deleting-{v}-{int(time.time())}"
        (drafters / v).rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(v)
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adaflash_operator.retention",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--traffic-days", type=int, required=True)
    ap.add_argument("--keep-versions", type=int, required=True)
    ap.add_argument("--fleet-version-file", type=Path,
                    help="file holding the fleet's version (the mounted ConfigMap key)")
    ap.add_argument("--protect", action="append", default=[], help="never delete this version")
    args = ap.parse_args(argv)
    if args.traffic_days < 1 or args.keep_versions < 1:
        ap.error("--traffic-days and --keep-versions must be at least 1")
    protect = set(args.protect)
    if args.fleet_version_file is not None:
        fleet = _read(args.fleet_version_file)
        if not fleet:  # never prune without knowing what the fleet serves
            print(f"retention: no fleet version in {args.fleet_version_file}; nothing pruned",
                  file=sys.stderr)
            return 1
        protect.add(fleet)
    files = prune_traffic(args.home, args.traffic_days, time.time())
    versions = prune_versions(args.home, args.keep_versions, protect)
    print(f"retention: removed {len(files)} traffic files older than {args.traffic_days} days; "
          f"drafter versions removed: {', '.join(versions) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
