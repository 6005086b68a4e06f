"""A stand-in for ``python -m sglang.launch_server`` in ``sglang_gpu_check.py --dry-run``: the
HTTP surface the check uses, on a CPU, in a second or two.

It takes SGLang's command line (the arguments it does not know are ignored) and serves:

- ``GET /health``;
- ``POST /generate`` with ``input_ids`` and ``sampling_params`` (``temperature``, ``top_k``,
  ``max_new_tokens``): tokens of a small deterministic pseudo-model, the same for every server
  (greedy: each token a function of the last two; sampled: a draw from a fixed softmax over
  four candidates), so plain, DFLASH and ADAFLASH servers agree exactly as lossless ones must;
- ``GET /metrics``: ``sglang:cuda_graph_passes_total`` and, for ADAFLASH, the ``adaflash_spec_*``
  counters, counted from the requests served (compact mode verifies 60% of what it drafts);
- ``GET /adaflash/v1/drafter``: the version it loaded from ``ADAFLASH_FLEET_VERSION_FILE``; its
  acceptance follows the loaded drafter's ``fc.weight`` (cosine similarity with the drafter it
  started with), so a random drafter accepts almost nothing.

``GPU_CHECK_STUB_FAULT`` (comma-separated) makes ADAFLASH compact servers misbehave, for testing
the check:
``lossy`` (a wrong greedy token), ``biased`` (a skewed sampled token), ``no-compaction``,
``no-graphs``, ``reload-ignored`` (acceptance does not follow the drafter), ``slow`` (four
times the step time). Each request sleeps for its decode steps, so throughput follows acceptance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VOCAB = 4096
BLOCK = 16
STEP_S = 0.03  # a decode step's time, so throughput follows the steps a request takes


def greedy_next(ctx: list[int]) -> int:
    a, b = ctx[-1], ctx[-2] if len(ctx) > 1 else 0
    return (a * 131 + b * 71 + 17) % VOCAB


def sampled_next(ctx: list[int], temperature: float, top_k: int, rng: random.Random,
                 biased: bool) -> int:
    base = greedy_next(ctx)
    cands = [(base + 97 * j) % VOCAB for j in range(4)][: max(1, top_k or 4)]
    weights = [math.exp(-0.8 * j / temperature) for j in range(len(cands))]
    if biased:
        weights[0] *= 0.3
    return rng.choices(cands, weights)[0]


class Stub:
    def __init__(self, args, fault: str):
        self.args = args
        self.faults = set(filter(None, fault.split(",")))
        self.mode = os.environ.get("ADAFLASH_VERIFY_MODE") if args.algorithm == "ADAFLASH" else None
        self.compact = self.mode == "compact"
        # sampled request k draws from its own generator: the samples are the same whatever
        # order the check's threads send them in
        self.seed = zlib.crc32(f"{args.algorithm}-{self.mode}-{args.attention_backend}".encode())
        self.sampled_requests = 0
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(("drafts", "draft_tokens", "verified_tokens",
                                     "accepted_tokens", "graph", "eager"), 0.0)  # fmt: skip
        self.loaded = Path(args.draft).name if args.draft else None
        self.reference = self._fc(Path(args.draft)) if self.mode else None
        self.acceptance = 1.5  # accepted proposals per draft with the original drafter
        if self.mode:
            threading.Thread(target=self._watch, daemon=True).start()

    @staticmethod
    def _fc(path: Path):
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))["fc.weight"].float().flatten()

    def _watch(self):
        fleet = os.environ.get("ADAFLASH_FLEET_VERSION_FILE")
        home = Path(os.environ.get("ADAFLASH_HOME", "."))
        while fleet:
            try:
                version = Path(fleet).read_text().strip()
            except OSError:
                version = self.loaded
            if version and version != self.loaded:
                fc = self._fc(home / "drafters" / version)
                cos = float(fc @ self.reference / (fc.norm() * self.reference.norm()))
                with self.lock:
                    if "reload-ignored" not in self.faults or not self.compact:
                        self.acceptance = 1.5 * max(0.0, cos)
                    self.loaded = version
            time.sleep(0.2)

    def generate(self, ids: list[int], params: dict) -> list[int]:
        temperature = float(params.get("temperature", 0.0))
        ctx, out = list(ids), []
        rng = None
        if temperature > 0:
            with self.lock:
                rng = random.Random(self.seed * 1_000_003 + self.sampled_requests)
                self.sampled_requests += 1
        for _ in range(int(params.get("max_new_tokens", 16))):
            if temperature <= 0:
                tok = greedy_next(ctx)
                if self.compact and "lossy" in self.faults and len(out) == 5:
                    tok = (tok + 1) % VOCAB
            else:
                tok = sampled_next(ctx, temperature, int(params.get("top_k", 0) or 0), rng,
                                   biased=self.compact and "biased" in self.faults and out != [])
            ctx.append(tok)
            out.append(tok)
        slow = 4 if "slow" in self.faults and self.compact else 1
        time.sleep(STEP_S * self._count(len(out)) * slow)
        return out

    def _count(self, n: int) -> int:
        """Count one request's decode steps into the metrics; returns how many it took."""
        with self.lock:
            a = self.acceptance if self.mode else 1.5
            steps = math.ceil(max(0, n - 1) / (1 + a)) if self.args.algorithm else max(0, n - 1)
            graphs = "no-graphs" not in self.faults or not self.compact
            self.counts["graph" if graphs else "eager"] += steps
            if self.mode:
                # the plugin counts each draft's candidate length: the head's lengths in
                # compact and cap mode, whole blocks in fixed mode
                share = 1.0 if self.mode == "fixed" else 0.6
                if self.compact and "no-compaction" in self.faults:
                    share = 1.0
                self.counts["drafts"] += steps
                self.counts["draft_tokens"] += steps * (BLOCK - 1)
                self.counts["verified_tokens"] += round(steps * (BLOCK - 1) * share)
                self.counts["accepted_tokens"] += steps * a
        return steps

    def metrics(self) -> str:
        c = self.counts
        lines = [
            f'sglang:cuda_graph_passes_total{{mode="decode_cuda_graph"}} {c["graph"]}',
            f'sglang:cuda_graph_passes_total{{mode="decode_none"}} {c["eager"]}',
        ]
        if self.mode:
            for key in ("drafts", "draft_tokens", "verified_tokens", "accepted_tokens"):
                lines.append(f'adaflash_spec_{key}_total{{domain=""}} {c[key]}')
            lines.append(f'adaflash_drafter_info{{version="{self.loaded}"}} 1.0')
        return "\n".join(lines) + "\n"


def serve(stub: Stub, host: str, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body: str, kind: str = "application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/metrics":
                self._send(200, stub.metrics(), "text/plain")
            elif self.path == "/adaflash/v1/drafter" and stub.mode:
                self._send(200, json.dumps({"loaded_version": stub.loaded}))
            else:
                self._send(404, "{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                return self._send(404, "{}")
            out = stub.generate(body["input_ids"], body.get("sampling_params", {}))
            self._send(200, json.dumps({"output_ids": out, "meta_info": {}}))

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # the check opens up to 64 connections at once
        daemon_threads = True

    Server((host, port), Handler).serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speculative-algorithm", dest="algorithm")
    ap.add_argument("--speculative-draft-model-path", dest="draft")
    ap.add_argument("--attention-backend", default="fa3")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    stub = Stub(args, os.environ.get("GPU_CHECK_STUB_FAULT", ""))
    if stub.mode:  # what the plugin logs at start-up (the check reads it)
        print(f"ADAFLASH: verify mode {stub.mode} on target attention backend "
              f"{args.attention_backend}", flush=True)  # fmt: skip
    serve(stub, args.host, args.port)


if __name__ == "__main__":
    main()
