"""ADAFLASH on a real GPU with stock SGLang 0.5.23: one command, non-zero exit on any failed check.

    pip install 'sglang-adaflash[sglang]'
    python scripts/sglang_gpu_check.py --out gpu-check

It starts every server at once on the one GPU (each with a memory share and a
``--max-total-tokens`` sized to the model and the workload, SGLang's deterministic inference
on), then checks what the CPU test suite cannot:

1. **T=0 losslessness**: at concurrency 1, 16 and 64, every speculative server (DFLASH; ADAFLASH
   compact, cap and fixed; ADAFLASH compact on each further attention backend the GPU and the
   plugin support; DSPARK when given its drafter) returns exactly plain decoding's tokens;
2. **T>0 distribution**: per speculative position, a server's sampled tokens are tested against
   plain decoding's (chi-square, same prompt, temperature and top-k); the control, plain
   decoding at another temperature, must be rejected by the same test. (No seeded repeat:
   DFLASH's sampled verification ignores ``sampling_seed``, and so does ADAFLASH built on it);
3. **evidence**: compact mode verified fewer proposals than it drafted (``adaflash_*``
   metrics), cap mode capped acceptance below whole blocks, fixed verified all, and decode passes replayed CUDA graphs
   (``sglang:cuda_graph_passes_total``);
4. **throughput**: each ADAFLASH mode against DFLASH (and DSPARK) at concurrency 1, 32 and 64,
   after a warm-up, one server at a time;
5. **hot reload under load** (ADAFLASH compact on the main backend): a deliberately bad drafter
   is published while requests run: it must load, acceptance must fall, outputs must stay
   equal to plain decoding; then a good one: acceptance must come back.

Thresholds: ``sglang_adaflash.bench.gpu_check.THRESHOLDS`` (repeated in the results). Results:
``OUT/results.json``; server logs: ``OUT/logs/``. By default it serves the embedded pair (no
download) on prompts from the embedded held-out workloads; ``--model-path``/``--draft-path``
serve a real pair. ``--dry-run`` runs everything on a CPU against a stub server process
(``scripts/gpu_check_stub_server.py``) to show the flow and the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_adaflash.bench import gpu_check as gc
from sglang_adaflash.fsio import write_json_atomic

HERE = Path(__file__).resolve().parent
EQUALITY_CONCURRENCY = (1, 16, 64)
THROUGHPUT_CONCURRENCY = (1, 32, 64)
ADAFLASH_MODES = ("compact", "cap", "fixed")
MAX_RUNNING = 64
SAMPLING = {"temperature": 0.8, "top_k": 4}  # the T>0 check's sampling
CONTROL_TEMPERATURE = 2.0  # plain decoding at this temperature must be told apart
SAMPLED_POSITIONS = range(1, 3)  # output positions decided by speculation (0 is prefill's)
FLUSH_S = 1.5  # the plugin exports its metrics from a background thread once a second


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# The GPU, the backends and the servers
# ---------------------------------------------------------------------------------------------


def backends_for(capability: tuple[int, int], compact_capable) -> tuple[str, list[str]]:
    """(main attention backend, further backends to run compact on) for a compute capability.

    The main backend is one SGLang runs deterministically and that verifies ragged layouts: FA3
    on Ampere/Ada/Hopper, FA4 on datacenter Blackwell, else Triton. The further ones are those
    of FlashInfer and Triton whose compact path the plugin has (``compact_capable``)."""
    major, _ = capability
    main = {8: "fa3", 9: "fa3", 10: "fa4"}.get(major, "triton")
    extra = [b for b in ("flashinfer", "triton") if b != main and b in compact_capable]
    return main, extra


@dataclass(frozen=True)
class ServerSpec:
    name: str
    algorithm: str | None  # None: plain decoding
    backend: str
    mode: str | None = None  # ADAFLASH_VERIFY_MODE
    draft: str | None = None

    @property
    def compact(self) -> bool:
        return self.mode == "compact"


def plan_servers(main: str, extra: list[str], modes, draft, dspark_draft=None) -> list[ServerSpec]:
    servers = [ServerSpec("plain", None, main), ServerSpec("dflash", "DFLASH", main, draft=draft)]
    servers += [ServerSpec(f"adaflash-{m}", "ADAFLASH", main, m, draft) for m in modes]
    if "compact" in modes:
        servers += [ServerSpec(f"adaflash-compact-{b}", "ADAFLASH", b, "compact", draft)
                    for b in extra]  # fmt: skip
    if dspark_draft:
        servers.append(ServerSpec("dspark", "DSPARK", main, draft=str(dspark_draft)))
    return servers


def max_total_tokens(prompt_lens: list[int], max_new: int, block: int) -> int:
    """KV slots for MAX_RUNNING of the longest requests plus a verify block each, rounded up."""
    need = MAX_RUNNING * (max(prompt_lens) + max_new + 2 * block)
    return -(-need // 4096) * 4096


def server_args(spec: ServerSpec, target: Path, max_tokens: int, mem_fraction: float) -> list[str]:
    args = ["--model-path", str(target), "--attention-backend", spec.backend,
            "--mem-fraction-static", f"{mem_fraction:.3f}", "--max-total-tokens", str(max_tokens),
            "--max-running-requests", str(MAX_RUNNING), "--random-seed", "0",
            "--enable-deterministic-inference", "--skip-tokenizer-init", "--enable-metrics"]  # fmt: skip
    if spec.algorithm:
        args += ["--speculative-algorithm", spec.algorithm,
                 "--speculative-draft-model-path", str(spec.draft)]  # fmt: skip
    return args


def mem_fraction_for(n_servers: int, dry_run: bool) -> float:
    """Every server starts at once. SGLang sizes its static memory as the free memory it sees
    minus (1 - fraction) of the total, so each server gets the fraction that leaves it its own
    share even after the others took theirs (the pool itself is capped by --max-total-tokens)."""
    if dry_run:
        return 0.9
    import torch

    free, total = torch.cuda.mem_get_info()
    share = min(12 << 30, free // (n_servers + 1))
    return min(0.95, 1 - (free - n_servers * share) / total)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: Any | None = None, timeout: float = 600) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text else None


class Server:
    """One server process group on 127.0.0.1; ``stop`` ends the group."""

    def __init__(self, spec: ServerSpec, cmd: list[str], env: dict[str, str], log_dir: Path):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{spec.name}.log"
        cmd = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        log(f"starting {spec.name}: {' '.join(cmd)}")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} during "
                                   f"start-up; see {self.log_path}")  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.spec.name} not ready in time; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generate(self, ids, max_new: int, **sampling) -> list[int]:
        params = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True, **sampling}
        return http_json(self.url + "/generate", {"input_ids": ids, "sampling_params": params})[
            "output_ids"
        ]

    def generate_all(self, batch, max_new: int, concurrency: int, **sampling) -> list[list[int]]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: self.generate(p, max_new, **sampling), batch))

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def settled_metrics(self) -> str:
        """/metrics once the plugin's background sink has exported (it merges once a second)."""
        last = None
        for _ in range(10):
            text = self.metrics()
            now = gc.adaflash_counts(text)
            if now == last:
                return text
            last = now
            time.sleep(1.2)
        return text


# ---------------------------------------------------------------------------------------------
# Drafter versions
# ---------------------------------------------------------------------------------------------


def adopt_drafter(home: Path, draft: Path, target: Path) -> Path:
    """Publish the drafter as v000001 on a fresh ADAFLASH_HOME, naming the served target."""
    from sglang_adaflash.drafter.checkpoint import read_checkpoint
    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_version

    cfg, state = read_checkpoint(draft, verify_manifest=False)
    return home / "drafters" / publish_version(home, cfg, state, target=target_fingerprint(target))


def publish_variant(home: Path, source: Path, parent: str, bad: bool, seed: int = 0) -> str:
    """The next version: the source's weights (good), or random weights of the same shapes,
    dtypes and scale (bad: it loads, and almost nothing it proposes is accepted)."""
    import torch

    from sglang_adaflash.drafter.checkpoint import read_checkpoint
    from sglang_adaflash.drafter.manifest import read_manifest
    from sglang_adaflash.drafter.store import publish_version

    cfg, state = read_checkpoint(source)
    if bad:
        g = torch.Generator().manual_seed(seed)
        state = {k: (torch.randn(v.shape, generator=g) * v.float().std()).to(v.dtype)
                 if v.is_floating_point() and v.numel() > 1 and not k.startswith("thresh_head")
                 else v for k, v in state.items()}  # fmt: skip
    return publish_version(home, cfg, state, target=read_manifest(source)["target"], parent=parent,
                           training={"algorithm": "gpu-check-" + ("bad" if bad else "good")})


def prompts(target: Path, n: int, max_len: int = 256) -> list[list[int]]:
    """Held-out prompts in the target's chat format (its own chat template when it has one)."""
    from transformers import AutoTokenizer

    from sglang_adaflash.assets import DOMAINS, workload_path
    from sglang_adaflash.assets.chat_format import render_prompt

    tok = AutoTokenizer.from_pretrained(str(target))
    rows = []
    for domain in DOMAINS:
        with open(workload_path(domain)) as f:
            rows.append([json.loads(line)["prompt"] for line in f])
    texts = [row[i % len(row)] for i in range(n) for row in rows][:n]
    out = []
    for text in texts:
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
        else:
            text = render_prompt(text)
        out.append(tok.encode(text, add_special_tokens=False)[-max_len:])
    return out


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """What plain decoding returned: the T=0 outputs, the sampled ones, and the control."""

    batch: list[list[int]]
    max_new: int
    outputs: list[list[int]]
    sample_prompt: list[int]
    samples: int
    sampled: list[list[int]] | None = None
    control: list[list[int]] | None = None

    def sample(self, server: Server, **sampling) -> list[list[int]]:
        n = max(SAMPLED_POSITIONS) + 1
        prompts = [self.sample_prompt] * self.samples
        return server.generate_all(prompts, n, MAX_RUNNING, **{**SAMPLING, **sampling})


def plain_reference(server: Server, ref: Reference) -> list[dict]:
    """Plain decoding's outputs at c=1, and its own batch invariance at c=16 and 64 (without it
    no speculative server can match); its sampled tokens and the control sample."""
    checks = []
    for c in EQUALITY_CONCURRENCY:
        got = server.generate_all(ref.batch, ref.max_new, c)
        if c == EQUALITY_CONCURRENCY[0]:
            ref.outputs = got
        else:
            checks.append(gc.equal_outputs(f"t0_equal_plain_c{c}_vs_c1", got, ref.outputs))
    ref.sampled = ref.sample(server)
    ref.control = ref.sample(server, temperature=CONTROL_TEMPERATURE)
    return checks


def speculative_checks(server: Server, ref: Reference) -> list[dict]:
    spec, checks = server.spec, []
    if spec.algorithm == "ADAFLASH":
        said = f"verify mode {spec.mode}" in server.log_text()
        checks.append(gc.check(f"{spec.name}_runs_in_{spec.mode}_mode", said))
    start = before_top = server.settled_metrics()
    for c in EQUALITY_CONCURRENCY:
        if c == EQUALITY_CONCURRENCY[-1]:
            before_top = server.settled_metrics()
        got = server.generate_all(ref.batch, ref.max_new, c)
        checks.append(gc.equal_outputs(f"t0_equal_{spec.name}_c{c}", got, ref.outputs))
    end = server.settled_metrics()
    passes = gc.delta(gc.graph_passes(end), gc.graph_passes(start))
    if spec.compact and spec.backend in eager_verify_backends():
        checks.append(gc.check(f"{spec.name}_verify_runs_eagerly", True, passes=passes,
                               note="compact verify on this backend has no CUDA graphs yet"))
    else:
        checks.append(gc.graph_replay(spec.name, passes))
    if spec.algorithm == "ADAFLASH":  # judged at the highest concurrency
        counts = gc.delta(gc.adaflash_counts(end), gc.adaflash_counts(before_top))
        checks.append(gc.compaction(spec.name, counts, spec.mode))
    checks.append(gc.same_distribution(spec.name, ref.sample(server), ref.sampled, ref.control,
                                       SAMPLED_POSITIONS))  # fmt: skip
    return checks


def throughput(server: Server, ref: Reference) -> list[dict]:
    server.generate_all(ref.batch[:8], ref.max_new, 8)  # warm-up
    rows = []
    for c in THROUGHPUT_CONCURRENCY:
        reqs = [ref.batch[i % len(ref.batch)] for i in range(max(2 * c, 16))]
        t0 = time.perf_counter()
        outs = server.generate_all(reqs, ref.max_new, c)
        wall = time.perf_counter() - t0
        tokens = sum(len(o) for o in outs)
        rows.append({"concurrency": c, "requests": len(reqs), "output_tokens": tokens,
                     "seconds": round(wall, 3), "tokens_per_s": tokens / wall})  # fmt: skip
        log(f"{server.spec.name} concurrency {c}: {tokens / wall:.1f} tok/s")
    return rows


class Load:
    """Requests at T=0 in a loop from background threads, each output checked against plain
    decoding's; ``stop`` returns (requests served, errors)."""

    def __init__(self, server: Server, ref: Reference, threads: int = 16):
        self.errors: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(server, ref, i), daemon=True)
                         for i in range(threads)]  # fmt: skip
        for t in self._threads:
            t.start()

    def _run(self, server, ref, i):
        while not self._stop.is_set():
            k = i % len(ref.batch)
            try:
                if server.generate(ref.batch[k], ref.max_new) != ref.outputs[k]:
                    self.errors.append(f"request {k}: output differs from plain decoding")
                self.done += 1
            except Exception as e:  # every failure is a failed check
                self.errors.append(repr(e))

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=600)
        return self.done, self.errors


def acceptance_window(server: Server, ref: Reference) -> tuple[float | None, bool]:
    """Accepted proposals per draft over one measured batch (c=16) and the load beside it,
    and whether the batch's outputs equalled plain decoding's. Each read waits out the
    plugin's metrics export (once a second), so a window holds only its own drafter's steps."""
    time.sleep(FLUSH_S)
    before = gc.adaflash_counts(server.metrics())
    got = server.generate_all(ref.batch, ref.max_new, 16)
    time.sleep(FLUSH_S)
    after = gc.adaflash_counts(server.metrics())
    return gc.acceptance_per_draft(gc.delta(after, before)), got == ref.outputs


def reload_under_load(server: Server, ref: Reference, home: Path, fleet: Path, v1: Path,
                      timeout: float) -> dict:
    """Publish a bad drafter while requests run (acceptance must fall, outputs stay equal),
    then a good one (acceptance must come back)."""
    load = Load(server, ref)
    phases: dict[str, Any] = {}
    try:
        phases["original"] = acceptance_window(server, ref)
        parent = v1.name
        for phase, bad in (("bad", True), ("good", False)):
            version = publish_variant(home, v1, parent, bad=bad, seed=1234)
            fleet.write_text(version + "\n")
            deadline, status = time.monotonic() + timeout, {}
            while time.monotonic() < deadline:
                status = http_json(server.url + "/adaflash/v1/drafter")
                if status.get("loaded_version") == version:
                    break
                time.sleep(0.5)
            phases[f"{phase}_loaded"] = status.get("loaded_version") == version
            phases[phase] = acceptance_window(server, ref)
            parent = version
            log(f"reload: {phase} drafter {version} loaded={phases[f'{phase}_loaded']} "
                f"acceptance={phases[phase][0]}")  # fmt: skip
    finally:
        served, errors = load.stop()
    base, bad, good = (phases.get(k, (None, False))[0] for k in ("original", "bad", "good"))
    t = gc.THRESHOLDS
    ok = (
        not errors and served > 0 and base and bad is not None and good is not None
        and phases.get("bad_loaded") and phases.get("good_loaded")
        and bad <= t["bad_drafter_max_acceptance_share"] * base
        and good >= t["good_drafter_min_acceptance_share"] * base
        and all(phases[k][1] for k in ("original", "bad", "good"))
    )  # fmt: skip
    return gc.check(f"hot_reload_under_load_{server.spec.name}", ok,
                    acceptance={"original": base, "bad": bad, "good": good},
                    loaded={k: phases.get(f"{k}_loaded") for k in ("bad", "good")},
                    outputs_equal={k: phases.get(k, (0, False))[1]
                                   for k in ("original", "bad", "good")},
                    requests_under_load=served, errors=errors[:10])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--model-path", type=Path, help="target model directory (default: embedded)")
    ap.add_argument("--draft-path", type=Path, help="its DFlash/AdaFlash drafter directory")
    ap.add_argument("--dspark-draft-path", help="a DSpark drafter for this target (adds DSPARK)")
    ap.add_argument("--attention-backend", help="main backend (default: chosen for the GPU)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--samples", type=int, default=512, help="sampled requests per T>0 test")
    ap.add_argument("--modes", default=",".join(ADAFLASH_MODES))
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--reload-timeout", type=float, default=60)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--min-throughput-ratio", type=float,
                    default=gc.THRESHOLDS["min_throughput_ratio"],
                    help="ADAFLASH / DFLASH (and / DSPARK) throughput below this fails; for a "
                    "real pair at high concurrency, ask for more than 1")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: stub server processes (scripts/gpu_check_stub_server.py) "
                    "stand in for SGLang, to show the flow and the report")
    ap.add_argument("--capability", default="9.0", help="with --dry-run: the GPU to pretend")
    return ap.parse_args(argv)


def plugin_compact_backends() -> frozenset[str]:
    from sglang_adaflash.sglang_plugin import server_args as sa

    return sa.RAGGED_VERIFY_BACKENDS | sa.EAGER_RAGGED_VERIFY_BACKENDS


def eager_verify_backends() -> frozenset[str]:
    """Backends whose compact verify the plugin runs without CUDA graphs (by design)."""
    from sglang_adaflash.sglang_plugin.server_args import EAGER_RAGGED_VERIFY_BACKENDS

    return EAGER_RAGGED_VERIFY_BACKENDS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    if args.dry_run:
        capability = tuple(int(x) for x in args.capability.split("."))
        gpu = f"dry run (stub servers, pretending sm{capability[0]}{capability[1]})"
        launcher = [sys.executable, str(HERE / "gpu_check_stub_server.py")]
    else:
        import torch

        if not torch.cuda.is_available():
            log("needs a CUDA GPU (or --dry-run)")
            return 2
        capability, gpu = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
        launcher = [sys.executable, "-m", "sglang.launch_server"]
    main_backend, extra = backends_for(capability, plugin_compact_backends())
    main_backend = args.attention_backend or main_backend
    modes = [m for m in args.modes.split(",") if m]

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    work = out / "work"
    if args.model_path:
        if args.draft_path is None:
            raise SystemExit("--model-path needs --draft-path")
        target, source_draft = args.model_path, args.draft_path
    else:
        from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR

        target, source_draft = TARGET_DIR, DRAFTER_DIR
    home = work / "home"
    v1 = adopt_drafter(home, source_draft, target)
    fleet = work / "fleet-drafter-version"
    fleet.write_text(v1.name + "\n")
    batch = prompts(target, args.requests)
    block = json.loads((v1 / "config.json").read_text()).get("block_size", 16)
    tokens = max_total_tokens([len(p) for p in batch], args.max_new_tokens, block)
    specs = plan_servers(main_backend, extra, modes, v1, args.dspark_draft_path)
    fraction = mem_fraction_for(len(specs), args.dry_run)
    log(f"{gpu}: main backend {main_backend}, compact also on {extra or 'nothing else'}; "
        f"{len(specs)} servers, --max-total-tokens {tokens}")  # fmt: skip

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ADAFLASH_")}

    def env_for(spec: ServerSpec) -> dict[str, str]:
        if spec.algorithm != "ADAFLASH":
            return base_env
        return dict(base_env, ADAFLASH_VERIFY_MODE=spec.mode, ADAFLASH_HOME=str(home),
                    ADAFLASH_FLEET_VERSION_FILE=str(fleet), ADAFLASH_RELOAD_POLL_S="0.5",
                    ADAFLASH_LOADED_VERSION_FILE=str(work / f"loaded-{spec.name}.json"),
                    ADAFLASH_ADMIN_OVERRIDE_FILE=str(work / f"override-{spec.name}"))  # fmt: skip

    results: dict[str, Any] = {
        "gpu": gpu, "capability": list(capability), "main_backend": main_backend,
        "compact_backends": [main_backend, *extra] if "compact" in modes else [],
        "pair": {"target": str(target), "draft": str(source_draft)},
        "thresholds": dict(gc.THRESHOLDS, min_throughput_ratio=args.min_throughput_ratio),
        "servers": {}, "checks": [], "throughput": {},
    }  # fmt: skip
    servers: dict[str, Server] = {}
    try:
        for spec in specs:
            cmd = [*launcher, *server_args(spec, target, tokens, fraction)]
            servers[spec.name] = Server(spec, cmd, env_for(spec), out / "logs")
            results["servers"][spec.name] = {"args": cmd[len(launcher):], "mode": spec.mode,
                                             "backend": spec.backend}  # fmt: skip
        deadline = time.monotonic() + args.startup_timeout
        for name, server in list(servers.items()):
            try:
                server.wait_ready(deadline)
            except (RuntimeError, TimeoutError) as e:
                results["checks"].append(gc.check(f"{name}_starts", False, error=str(e)))
                server.stop()
                del servers[name]
        log(f"{len(servers)} servers ready after {time.monotonic() - t_start:.0f}s")
        if "plain" not in servers:
            raise RuntimeError("plain decoding did not start: nothing to compare with")
        ref = Reference(batch, args.max_new_tokens, [], batch[0], args.samples)
        results["checks"] += plain_reference(servers["plain"], ref)
        spec_servers = [s for n, s in servers.items() if n != "plain"]
        with ThreadPoolExecutor(max(1, len(spec_servers))) as pool:
            for checks in pool.map(lambda s: speculative_checks(s, ref), spec_servers):
                results["checks"] += checks
        if not args.skip_throughput:  # one server at a time, the others idle
            for name, server in servers.items():
                if server.spec.backend == main_backend:
                    results["throughput"][name] = throughput(server, ref)
            results["ratios"] = gc.ratio_rows(results["throughput"], args.min_throughput_ratio)
            for row in results["ratios"]:
                results["checks"].append(gc.check(
                    f"throughput_{row['adaflash']}_vs_{row['vs']}_c{row['concurrency']}",
                    row["ok"], ratio=row["ratio"]))  # fmt: skip
        reload_on = next((s for s in spec_servers if s.spec.algorithm == "ADAFLASH"
                          and s.spec.backend == main_backend), None)  # fmt: skip
        if reload_on is not None:
            results["checks"].append(
                reload_under_load(reload_on, ref, home, fleet, v1, args.reload_timeout))
    except Exception as e:  # report what ran, then fail
        results["checks"].append(gc.check("run", False, error=repr(e)))
    finally:
        for server in servers.values():
            server.stop()
    elapsed = time.monotonic() - t_start
    results["elapsed_s"] = round(elapsed, 1)
    if not args.dry_run:
        results["checks"].append(gc.check("within_time_budget", elapsed <= gc.THRESHOLDS["max_seconds"],
                                          seconds=round(elapsed, 1)))  # fmt: skip
    failed = [c["check"] for c in results["checks"] if not c["ok"]]
    results["ok"] = not failed
    write_json_atomic(out / "results.json", results, default=str)  # fsynced, renamed
    log(f"{'PASSED' if results['ok'] else 'FAILED ' + ', '.join(failed)}: {out / 'results.json'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
