"""Where a decode step's time goes, per mode, on one device: the host-side breakdown.

On the first GPU run (benchmarks/gpu/README.md) `adaflash` and `d2sd` steps cost several times a
`dflash` step, more than their extra kernels explain. This script, run on the device, measures
each mode's steps after a full warm-up pass:
- milliseconds per decode step (wall clock, the device synchronised at both ends);
- host-device synchronisations per step, counted by torch's sync debug mode (CUDA only);
- the profiler's top entries by self CPU time, and the CUDA runtime calls per step (launches,
  copies, synchronisations), which on a launch-bound model are what a step's time is made of.

    python benchmarks/gpu/profile_steps.py --device cuda --dtype bfloat16 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch
from embedded import load, make_requests
from torch.profiler import ProfilerActivity, profile

from sglang_adaflash.core.clock import synced_time
from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.engine_factory import make_engine

RUNTIME_CALLS = ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                 "cudaMalloc", "cudaFree", "cudaEventSynchronize")


def counted_steps(engine):
    """Wrap the engine's step: a list that collects each step's wall seconds."""
    times, step = [], engine._decode_step

    def timed():
        t0 = synced_time(engine.device)
        step()
        times.append(synced_time(engine.device) - t0)

    engine._decode_step = timed
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", default="ar,dflash,adaflash,d2sd")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    pair, prompts = load(args.device, args.dtype, args.requests, d2sd={})
    max_seq = max(len(p) for p in prompts) + args.max_new_tokens
    cuda = args.device.startswith("cuda")

    def requests():
        return make_requests(pair, prompts, args.max_new_tokens)

    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        for mode in args.modes.split(","):
            engine = make_engine(pair, mode, c, max_seq, 0, num_requests=len(prompts))
            engine.run(requests())  # warm-up: allocator, cost profile, every batch shape once
            times = counted_steps(engine)
            t0 = time.perf_counter()
            engine.run(requests())
            wall = time.perf_counter() - t0
            steps = len(times)
            ms_step = 1e3 * sorted(times)[steps // 2] if times else None  # unprofiled, median
            syncs = None
            if cuda:  # every synchronisation torch knows of warns once per occurrence in this mode
                times.clear()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        engine.run(requests())
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = sum("synchroniz" in str(w.message) for w in caught) / max(len(times), 1)
            times.clear()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                engine.run(requests())
            n = max(len(times), 1)
            table = prof.key_averages()
            top = sorted(table, key=lambda e: -e.self_cpu_time_total)[: args.top]
            calls = {e.key: e.count / n for e in table if e.key in RUNTIME_CALLS}
            # what the profiler saw of the host's time; the rest of a step's wall time is Python
            # between ops (and the profiler's own overhead)
            aten_ms = sum(e.self_cpu_time_total for e in table if e.key.startswith("aten::")) / 1e3 / n
            runtime_ms = sum(e.self_cpu_time_total for e in table if e.key.startswith("cuda")) / 1e3 / n
            row = {"mode": mode, "concurrency": c, "steps": steps, "wall_s": wall,
                   "ms_per_step_median": ms_step,
                   "syncs_per_step": syncs, "runtime_calls_per_step": calls,
                   "aten_self_cpu_ms_per_step": aten_ms, "cuda_runtime_cpu_ms_per_step": runtime_ms,
                   "top_self_cpu_ms_per_step": [(e.key, e.self_cpu_time_total / 1e3 / n, e.count / n) for e in top]}
            rows.append(row)
            print(f"c={c:3d} {mode:9s} {ms_step:.2f} ms/step, syncs/step {syncs}, "
                  f"profiled (slower): aten {aten_ms:.2f} ms/step, CUDA runtime {runtime_ms:.2f} ms/step, "
                  f"calls/step {({k: round(v, 1) for k, v in calls.items()})}", flush=True)
            for key, ms, count in row["top_self_cpu_ms_per_step"][:8]:
                print(f"      {ms:8.3f} ms/step  {count:7.1f} calls/step  {key}", flush=True)
            del engine
    doc = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__,
           "cuda": torch.cuda.get_device_name(0) if cuda else None, "config": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows}
    write_text_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
