"""Server overhead: throughput through `adaflash serve` against the engine called directly.

    python -m sglang_adaflash.server.overhead --target DIR --drafter DIR --prompts FILE.jsonl \
        --concurrency 1,32 --max-new-tokens 48 --num-prompts 8 --waves 4 --repeats 3 \
        --threads 1 --ignore-eos --out DIR

For every concurrency c both sides serve the same requests: the prompts of ``adaflash bench``'s
workload (same tokenization, same cycling, same lengths), n = max(waves * c, num_prompts) of
them, T=0, in one mode.

- **direct**: ``SpecEngine.run`` on all n requests with ``max_batch_size = c``, in this process;
- **http**: an ``adaflash serve`` process with ``--max-batch-size c`` (metrics and traffic
  records on, as a server runs by default) and c client coroutines here, each posting its next
  request to ``/v1/completions`` (prompt as token ids) as soon as its previous answer arrived.
  ``--server URL`` measures a server that is already running instead.

Throughput is generated tokens / wall seconds of the whole run; the server's start-up is not
timed (one warm-up request goes first). Runs are interleaved (each repeat visits both sides, in
alternating order) and the reported ratio is the median of per-repeat http/direct ratios, with
the same ratio of tokens per CPU-second (server process vs. this process while it runs the
engine) beside it: on a shared machine the CPU figure moves less. Every T=0 output through HTTP
must equal the direct one token for token; a mismatch is reported and makes the exit code 1.

results.json holds no absolute path of the machine that wrote it (as ``adaflash bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS_NAME = "results.json"
GOAL = 0.85


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its threads, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """`adaflash serve` in a child process on 127.0.0.1 and a free port."""

    def __init__(self, args: list[str], home: str):
        cmd = [sys.executable, "-m", "sglang_adaflash.cli.main", "serve", "--host", "127.0.0.1", "--port", "0",
               "--home", home, "--log-level", "warning", *args]
        # stderr to a file: a pipe nobody drains would block the server once it fills.
        self.log = open(Path(home) / f"serve-{time.time_ns()}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        deadline = time.monotonic() + 300
        self.url = None
        while time.monotonic() < deadline and self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                raise RuntimeError(f"adaflash serve exited: {self.log.read()[-2000:]}")
            if "listening on " in line:
                self.url = line.rsplit("listening on ", 1)[1].strip()
        if self.url is None:
            raise RuntimeError("adaflash serve did not start within 300 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


async def _http_run(url: str, model: str, requests, concurrency: int, stream: bool) -> tuple[float, list[list[int]]]:
    """Serve `requests` through the server with `concurrency` closed-loop clients."""
    import httpx

    outputs: list[list[int] | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def client(http: httpx.AsyncClient) -> None:
        for i in next_index:
            req = requests[i]
            body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.sampling.max_new_tokens,
                    "temperature": 0, "ignore_eos": not req.sampling.stop_token_ids, "return_token_ids": True}
            r = await http.post("/v1/completions", json=body)
            r.raise_for_status()
            outputs[i] = r.json()["choices"][0]["token_ids"]

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        warm = {"model": model, "prompt": requests[0].prompt_ids, "max_tokens": 2, "temperature": 0}
        (await http.post("/v1/completions", json=warm)).raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, outputs


def _direct_run(pair, mode: str, concurrency: int, requests, seed: int) -> tuple[float, float, list[list[int]]]:
    from ..core.sampling import SamplingParams
    from ..engine.request import Request
    from ..launch.engine_factory import make_engine

    max_seq = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    engine = make_engine(pair, mode, concurrency, max_seq, seed, batch_flag="--concurrency")
    # As the server does before it serves: profile the step cost, warm the caches.
    engine.run([Request(list(requests[0].prompt_ids), SamplingParams(max_new_tokens=2), request_id="warm-up")])
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = engine.run(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return wall, cpu, [o.output_ids for o in outs]


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_adaflash.server.overhead",
                                description="Throughput through adaflash serve vs the engine called directly.")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter")
    p.add_argument("--prompts", required=True, nargs="+")
    p.add_argument("--mode", default="adaflash", choices=("ar", "dflash", "adaflash"))
    p.add_argument("--concurrency", type=_int_list, default=[1, 32])
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads, here and in the server")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--server", metavar="URL", help="measure this running server instead of starting one per concurrency")
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from ..bench.runner import BenchConfig, build_workload, recorded_command, recorded_path
    from ..fsio import write_json_atomic
    from ..launch.engine_factory import model_dir_arg as _model_dir
    from ..launch.loading import load_pair
    from ..launch.prompts import read_prompts

    args = build_parser().parse_args(argv)
    target, drafter = _model_dir("target")(args.target), _model_dir("drafter")(args.drafter) if args.drafter else None
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(target, drafter, dtype=args.dtype, need_drafter=args.mode != "ar")
    cfg = BenchConfig(target=target, drafter=drafter, prompts=args.prompts, concurrency=args.concurrency,
                      modes=[args.mode], max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                      waves=args.waves, seed=args.seed, ignore_eos=args.ignore_eos)
    specs = read_prompts(args.prompts)
    most = max(max(args.waves * c, args.num_prompts or 0) for c in args.concurrency)
    workload = build_workload(specs, pair, cfg, most)
    stop_ids = () if args.ignore_eos else pair.stop_token_ids
    serve_args = ["--target", target, "--mode", args.mode]
    if drafter:
        serve_args += ["--drafter", drafter]
    if args.threads:
        serve_args += ["--threads", str(args.threads)]
    if args.dtype:
        serve_args += ["--dtype", args.dtype]
    model = "overhead"
    serve_args += ["--model-name", model, "--seed", str(args.seed)]

    rows, mismatches = [], 0
    with tempfile.TemporaryDirectory(prefix="adaflash-overhead-") as home:
        for c in args.concurrency:
            n = max(args.waves * c, len(workload.prompts))
            requests = workload.requests(n, stop_ids)
            # The server's KV slots as long as the direct engine's, so both attend over the same.
            max_seq = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
            server = None if args.server else ServerProcess(
                [*serve_args, "--max-batch-size", str(c), "--max-seq-len", str(max_seq)], home)
            url = args.server or server.url
            samples = {"direct": [], "http": [], "direct_cpu": [], "http_cpu": []}
            tokens = None
            try:
                for rep in range(args.repeats):
                    for side in (("direct", "http") if rep % 2 == 0 else ("http", "direct")):
                        if side == "direct":
                            wall, cpu, outs = _direct_run(pair, args.mode, c, requests, args.seed)
                            direct_outs = outs
                        else:
                            cpu0 = _cpu_seconds(server.proc.pid) if server else None
                            wall, outs = asyncio.run(_http_run(url, model, requests, c, stream=False))
                            cpu = _cpu_seconds(server.proc.pid) - cpu0 if server else None
                            http_outs = outs
                        tokens = sum(len(o) for o in outs)
                        samples[side].append(tokens / wall)
                        samples[side + "_cpu"].append(tokens / cpu if cpu else None)
                    bad = sum(a != b for a, b in zip(direct_outs, http_outs))
                    mismatches += bad
            finally:
                if server is not None:
                    server.stop()
            ratios = [h / d for h, d in zip(samples["http"], samples["direct"])]
            cpu_ratios = [h / d for h, d in zip(samples["http_cpu"], samples["direct_cpu"]) if h and d]
            row = {"concurrency": c, "requests": n, "tokens": tokens,
                   "direct_tok_s": statistics.median(samples["direct"]),
                   "http_tok_s": statistics.median(samples["http"]),
                   "ratio": statistics.median(ratios), "ratio_samples": ratios,
                   "cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else None,
                   "direct_tok_s_samples": samples["direct"], "http_tok_s_samples": samples["http"],
                   "meets_goal": statistics.median(ratios) >= GOAL}
            rows.append(row)
            print(f"c={c:3d}  direct {row['direct_tok_s']:8.1f} tok/s  http {row['http_tok_s']:8.1f} tok/s  "
                  f"ratio {row['ratio']:.3f}  cpu ratio {row['cpu_ratio'] if row['cpu_ratio'] is None else round(row['cpu_ratio'], 3)}",
                  flush=True)

    doc = {
        "command": "python -m sglang_adaflash.server.overhead"
                   + recorded_command(sys.argv[1:] if argv is None else argv).removeprefix("adaflash"),
        "config": {"target": recorded_path(target), "drafter": recorded_path(drafter),
                   "prompts": [recorded_path(p) for p in args.prompts], "mode": args.mode,
                   "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
                   "num_prompts": args.num_prompts, "waves": args.waves, "repeats": args.repeats,
                   "threads": args.threads, "dtype": args.dtype or str(pair.target.dtype).removeprefix("torch."),
                   "ignore_eos": args.ignore_eos, "server": "given" if args.server else "adaflash serve per concurrency",
                   "client": "httpx, closed loop, non-streamed /v1/completions, prompt as token ids"},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                        "load_average": list(os.getloadavg())},
        "goal": GOAL,
        "results": rows,
        "equality": {"ok": mismatches == 0, "mismatches": mismatches},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / RESULTS_NAME, doc)
    print(f"wrote {out / RESULTS_NAME}; T=0 outputs {'equal' if mismatches == 0 else f'DIFFER in {mismatches}'}")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
