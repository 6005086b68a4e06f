"""How long a hot swap holds the decode loop: ``HotReloader.at_step_boundary`` timed in-process.

What `adaflash serve` does between two decode steps when a new drafter version is staged: copy
the live drafter into the rollback buffers, copy the staged weights in, report the new status.
The shipped drafter (2.3 MB) is published ``--swaps + 1`` times on a temporary volume; one
reloader (built as the server builds it, with its status-file reporter) stages each next version
on this thread, waits, then swaps, and a decode step's worth of matrix products runs between
swaps. The first swap is reported apart: it is the one that first writes the rollback buffers.

    python benchmarks/reload/swap_pause.py --out benchmarks/reload/results.json
    python benchmarks/reload/swap_pause.py --root <an export of another commit> --label old ...

``--root`` imports the package from another checkout (an export of an older commit), so two
versions of the code are timed on the same machine in the same minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def measure(root: Path, swaps: int) -> dict:
    sys.path.insert(0, str(root))
    import torch

    from sglang_adaflash.drafter.checkpoint import load_drafter
    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_checkpoint
    from sglang_adaflash.server.reload import build_reloader, reload_env

    torch.set_num_threads(1)
    assets = root / "sglang_adaflash" / "assets" / "models"
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        fp = target_fingerprint(assets / "target")
        for _ in range(swaps + 1):
            publish_checkpoint(home, assets / "drafter", target=fp)
        drafter = load_drafter(home / "drafters" / "v000001", dtype=torch.float32).eval()
        env = reload_env(home, True, base={})
        reloader = build_reloader(drafter, env=env, loaded_version="v000001", pinned=None,
                                  target_dir=assets / "target", sink=None, poll_s=0.5)
        step = torch.randn(512, 512)
        ms = []
        for v in range(2, swaps + 2):
            reloader.source.base.read = lambda v=v: (f"v{v:06d}", "latest")
            reloader.poll_once()  # stage (the watcher thread's work in the server)
            time.sleep(0.2)  # the status it reported lands
            t0 = time.perf_counter()
            swapped = reloader.at_step_boundary()
            ms.append((time.perf_counter() - t0) * 1e3)
            assert swapped == f"v{v:06d}", swapped
            for _ in range(20):  # a decode step's worth of work before the next swap
                step @ step
        reloader.stop()
    return {"first_ms": round(ms[0], 3), "later_median_ms": round(statistics.median(ms[1:]), 3),
            "later_max_ms": round(max(ms[1:]), 3), "all_ms": [round(x, 3) for x in ms]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(HERE), help="the checkout whose package is timed")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--swaps", type=int, default=16)
    ap.add_argument("--out", help="append the result to this JSON list")
    args = ap.parse_args()
    res = {"label": args.label, "swaps": args.swaps, **measure(Path(args.root), args.swaps)}
    print(json.dumps({k: v for k, v in res.items() if k != "all_ms"}))
    if args.out:
        path = Path(args.out)
        rows = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(rows + [res], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
