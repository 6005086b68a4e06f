"""Per-step cost of the ADAFLASH metrics on the SGLang scheduler thread.

The SGLang worker hands every decode step's verify lengths and accept counts to its metrics
(``StepStatsQueue.complete``, called from ``on_verify_complete_cpu`` on the scheduler thread of
TP rank 0). This times that call, as the worker wires it, for batches of ``--bs`` requests with
a few domain tags, against a real ``PrometheusSink`` in multiprocess mode (what
``--enable-metrics`` gives) plus the ``LoggingSink``:

- ``inline``: the sinks run on the calling thread (how the worker was wired before);
- ``background`` (if this checkout has ``BackgroundSink``): the call only queues the step; a
  daemon thread merges and exports; its cost is reported separately (``flush``), since it
  still shares the GIL with the scheduler.

    python benchmarks/sglang_metrics/step_cost.py --bs 64 --steps 2000 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="adaflash-metrics-bench-")
    import prometheus_client

    from sglang_adaflash.serving import metrics as m
    from sglang_adaflash.sglang_plugin.runtime import StepStatsQueue

    rng = random.Random(0)
    steps = []
    for _ in range(args.steps):
        lens = [rng.randint(2, args.block) for _ in range(args.bs)]
        acc = [rng.randint(0, n - 1) for n in lens]
        domains = [rng.choice(["code", "math", None]) for _ in range(args.bs)]
        steps.append((lens, acc, domains))

    def run(background: bool) -> dict:
        registry = prometheus_client.CollectorRegistry()
        sinks = m.FanoutSink([m.LoggingSink(), m.PrometheusSink(registry, max_block_size=args.block)])
        sink = m.BackgroundSink(sinks, interval_s=3600) if background else sinks
        queue = StepStatsQueue(sink)
        per_step = []
        for lens, acc, domains in steps:
            t0 = time.perf_counter()
            queue.push(args.block, lens, domains)
            queue.complete(acc)
            per_step.append(time.perf_counter() - t0)
        flush_s = 0.0
        if background:
            t0 = time.perf_counter()
            sink.flush()
            flush_s = time.perf_counter() - t0
            sink.stop()
        return {"scheduler_ms_per_step": 1e3 * statistics.mean(per_step),
                "flush_ms_per_step": 1e3 * flush_s / len(steps)}

    modes = ["inline"] + (["background"] if hasattr(m, "BackgroundSink") else [])
    results = {"bs": args.bs, "block": args.block, "steps": args.steps, "python": sys.version.split()[0]}
    for mode in modes:
        runs = [run(mode == "background") for _ in range(args.repeats)]
        results[mode] = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
        print(f"{mode}: {results[mode]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
