"""ADAFLASH on a real GPU with stock SGLang 0.5.23: one command, non-zero exit on any failed check.

    pip install 'sglang-adaflash[sglang]'
    python scripts/sglang_gpu_check.py --out gpu-check

What it checks that the CPU test suite cannot (the suite runs SGLang's scheduler on CPU with
CUDA-only kernels swapped out; see docs/sglang.md):

1. **losslessness**, with SGLang's deterministic inference on
   (``--enable-deterministic-inference``):
   at temperature 0 every speculative server (DFLASH, and ADAFLASH in compact, cap and fixed
   mode) produces exactly the tokens of plain decoding, request by request; a temperature > 0
   batch completes on each of them with no failed request;
2. **hot reload under load** (ADAFLASH, compact mode where the GPU allows it, else auto): while
   32 requests run, a new drafter version is published; the server must load it, no request
   may fail, and temperature-0 outputs must still equal plain decoding afterwards;
3. **throughput** (deterministic inference off): output tokens per second at concurrency 1, 32
   and 64 for DFLASH, each ADAFLASH mode and, given a DSpark drafter, DSPARK; it prints
   ADAFLASH / DFLASH (and ADAFLASH / DSPARK) ratios.

By default it serves the embedded pair (``sglang_adaflash/assets/models/{target,drafter}``, no
download) with prompts from the embedded held-out workloads; the drafter is published as
``v000001`` on a fresh ``ADAFLASH_HOME`` and the reload publishes a perturbed copy. The
embedded target is tiny, so its throughput ratios measure the per-step overheads more than
the savings; pass ``--model-path`` and ``--draft-path`` for a real pair. The attention backend
follows the GPU (``backend_for``); ``--attention-backend`` overrides it. Results go to
``OUT/results.json``, server logs to ``OUT/logs/``.
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
from pathlib import Path
from typing import Any

CONCURRENCY = (1, 32, 64)
ADAFLASH_MODES = ("compact", "cap", "fixed")


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# The GPU and the model pair
# ---------------------------------------------------------------------------------------------


def backend_for(capability: tuple[int, int]) -> tuple[str, str | None]:
    """(attention backend, why compact mode cannot run or None) for a CUDA compute capability.

    The backend must verify ragged layouts (compact mode) and be one SGLang runs
    deterministically: FA3 on Ampere/Ada/Hopper, FA4 on datacenter Blackwell (SGLang's
    deterministic list has no trtllm_mha). Elsewhere Triton, which verifies ragged layouts
    through the plugin's extension of SGLang's Triton backend.
    """
    major, _ = capability
    if major in (8, 9):
        return "fa3", None
    if major == 10:
        return "fa4", None
    return "triton", None


def embedded_pair() -> tuple[Path, Path]:
    from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR

    return TARGET_DIR, DRAFTER_DIR


def perturbed(state: dict, seed: int) -> dict:
    """The same weights plus 2% noise: a version that really differs, for the reload."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if t.is_floating_point() and t.numel() > 1:
            noise = torch.randn(t.shape, generator=g) * (0.02 * float(t.float().std()))
            t = (t.float() + noise).to(t.dtype)
        out[name] = t
    return out


def adopt_drafter(home: Path, draft: Path, target: Path) -> Path:
    """Publish the drafter as v000001 on a fresh ADAFLASH_HOME, naming the served target."""
    from sglang_adaflash.drafter.checkpoint import read_checkpoint
    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_version

    cfg, state = read_checkpoint(draft, verify_manifest=False)
    version = publish_version(home, cfg, state, target=target_fingerprint(target))
    return home / "drafters" / version


def publish_next(home: Path, current: Path, seed: int) -> str:
    """The next version: the current weights, perturbed."""
    from sglang_adaflash.drafter.checkpoint import read_checkpoint
    from sglang_adaflash.drafter.manifest import read_manifest
    from sglang_adaflash.drafter.store import publish_version

    cfg, state = read_checkpoint(current)
    manifest = read_manifest(current)
    return publish_version(
        home,
        cfg,
        perturbed(state, seed),
        target=manifest["target"],
        parent=manifest.get("version"),
        training={"algorithm": "gpu-check-perturbation"},
    )


def prompts(target: Path, n: int, max_len: int = 256) -> list[list[int]]:
    """Token ids of held-out prompts in the chat format the target was trained on (the embedded
    workloads, rendered with the target's own chat template when it has one)."""
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
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        else:
            text = render_prompt(text)
        out.append(tok.encode(text, add_special_tokens=False)[-max_len:])
    return out


# ---------------------------------------------------------------------------------------------
# Servers and requests
# ---------------------------------------------------------------------------------------------


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
    """One SGLang server in its own process group on 127.0.0.1; ``stop`` ends the group."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--enable-metrics",
        ]
        self.log_path = log_dir / f"{name}.log"
        log(f"starting {name}: {' '.join(cmd)}")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} during start-up; see "
                    f"{self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        log(f"{self.name} ready on {self.url}")
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, seed=None):
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        if seed is not None:
            params["sampling_seed"] = seed
        out = http_json(self.url + "/generate", {"input_ids": input_ids, "sampling_params": params})
        return out["output_ids"]


def generate_all(server: Server, batch, max_new: int, concurrency: int = 16, **kw):
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: server.generate(p, max_new, **kw), batch))


def run_load(server: Server, batch, concurrency: int, max_new: int) -> dict[str, Any]:
    reqs = [batch[i % len(batch)] for i in range(max(len(batch), 2 * concurrency))]
    t0 = time.perf_counter()
    outs = generate_all(server, reqs, max_new, concurrency=concurrency)
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    return {
        "concurrency": concurrency,
        "requests": len(reqs),
        "output_tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": tokens / wall,
    }


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def check_equal(name: str, got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    mismatches = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    ok = not mismatches and len(got) == len(want)
    log(f"T=0 equality {name}: {'OK' if ok else f'{len(mismatches)} mismatching requests'}")
    return {"check": f"t0_equal_{name}", "ok": ok, "mismatching_requests": mismatches[:10]}


def sampled_smoke(name: str, server: Server, batch, max_new: int) -> dict[str, Any]:
    """Temperature 0.8: every request completes with max_new tokens, and sampling happened
    (the same prompt twice gives two outputs). No seeded repeat: DFLASH's sampled verification
    ignores ``sampling_seed``, and so does every ADAFLASH mode built on it."""
    try:
        outs = generate_all(server, batch, max_new, temperature=0.8)
        twice = generate_all(server, [batch[0]] * 4, max_new, temperature=0.8)
        sampled = len({tuple(o) for o in twice}) > 1
        ok = all(len(o) == max_new for o in outs) and sampled
        detail = {"lengths": sorted({len(o) for o in outs}), "sampled_outputs_differ": sampled}
    except Exception as e:  # any failure is a failed check
        ok, detail = False, {"error": repr(e)}
    log(f"T>0 smoke {name}: {'OK' if ok else detail}")
    return {"check": f"t_gt_0_smoke_{name}", "ok": ok, **detail}


def hot_reload_under_load(
    server: Server, home: Path, draft: Path, fleet_file: Path, batch, max_new: int, timeout: float
) -> dict[str, Any]:
    errors: list[str] = []
    stop = threading.Event()
    done = [0]

    def worker(p):
        while not stop.is_set():
            try:
                server.generate(p, max_new)
                done[0] += 1
            except Exception as e:  # every failure is a failed check
                errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(p,), daemon=True) for p in batch[:32]]
    status: dict[str, Any] = {}
    new_version = None
    try:
        for t in threads:
            t.start()
        time.sleep(5)
        new_version = publish_next(home, draft, seed=1234)
        fleet_file.write_text(new_version + "\n")
        log(f"published {new_version} and asked for it under load")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = http_json(server.url + "/adaflash/v1/drafter")
            if status.get("loaded_version") == new_version:
                break
            time.sleep(1)
        time.sleep(5)  # keep serving on the new weights for a while
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=600)
    ok = new_version is not None and status.get("loaded_version") == new_version and not errors
    log(
        f"hot reload: loaded={status.get('loaded_version')} requests={done[0]} errors={len(errors)}"
    )
    return {
        "check": "hot_reload_under_load",
        "ok": ok,
        "new_version": new_version,
        "status": status,
        "requests_completed": done[0],
        "errors": errors[:10],
    }


def metric_total(metrics: str, name: str) -> float:
    """Sum of a Prometheus series over its labels, from /metrics text."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def compaction_evidence(name: str, metrics: str) -> dict[str, Any]:
    """Compact mode must verify fewer proposals than it drafted (a silent fallback to whole
    blocks verifies all of them); other modes verify every proposal."""
    drafted = metric_total(metrics, "adaflash_spec_draft_tokens_total")
    verified = metric_total(metrics, "adaflash_spec_verified_tokens_total")
    compact = name.endswith("compact")
    ok = drafted > 0 and ((verified < drafted) if compact else (verified == drafted))
    return {"check": f"{name}_verified_vs_drafted", "ok": ok, "drafted": drafted,
            "verified": verified}  # fmt: skip


def ratio_table(throughput: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """ADAFLASH (each mode) over DFLASH, and over DSPARK when it ran, per concurrency."""
    rows = []
    by = {
        name: {r["concurrency"]: r["tokens_per_s"] for r in runs}
        for name, runs in throughput.items()
    }
    for name in sorted(n for n in by if n.startswith("adaflash")):
        for base in ("dflash", "dspark"):
            if base not in by:
                continue
            for c in sorted(by[name]):
                if c in by[base] and by[base][c] > 0:
                    rows.append(
                        {
                            "adaflash": name,
                            "vs": base,
                            "concurrency": c,
                            "ratio": round(by[name][c] / by[base][c], 3),
                        }
                    )
    return rows


def server_configs(target, draft, backend: str, modes, mem_fraction: str, dspark_draft=None):
    """(name, SGLang arguments, ADAFLASH verify mode or None) of every server the check runs;
    each also gets --enable-deterministic-inference for the equality phase."""
    base = [
        "--model-path",
        str(target),
        "--attention-backend",
        backend,
        "--mem-fraction-static",
        str(mem_fraction),
        "--max-running-requests",
        "64",
        "--random-seed",
        "0",
    ]
    spec = ["--speculative-draft-model-path", str(draft)]
    out = [
        ("plain", base, None),
        ("dflash", [*base, "--speculative-algorithm", "DFLASH", *spec], None),
    ]
    for mode in modes:
        out.append(
            (f"adaflash-{mode}", [*base, "--speculative-algorithm", "ADAFLASH", *spec], mode)
        )
    if dspark_draft:
        out.append(
            (
                "dspark",
                [
                    *base,
                    "--speculative-algorithm",
                    "DSPARK",
                    "--speculative-draft-model-path",
                    str(dspark_draft),
                ],
                None,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--model-path", type=Path, help="target model directory (default: embedded)")
    ap.add_argument("--draft-path", type=Path, help="its DFlash/AdaFlash drafter directory")
    ap.add_argument("--dspark-draft-path", help="a DSpark drafter for this target (adds DSPARK)")
    ap.add_argument("--attention-backend", help="default: chosen for this GPU (backend_for)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--modes", default=",".join(ADAFLASH_MODES))
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--reload-timeout", type=float, default=180)
    ap.add_argument("--mem-fraction-static", default="0.5")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        log("needs a CUDA GPU")
        return 2
    capability = torch.cuda.get_device_capability()
    backend, no_compact = backend_for(capability)
    backend = args.attention_backend or backend
    modes = [m for m in args.modes.split(",") if m]
    if no_compact and "compact" in modes:
        log(f"compact mode skipped: {no_compact}")
        modes.remove("compact")
    log(
        f"GPU {torch.cuda.get_device_name()} (sm{capability[0]}{capability[1]}): "
        f"attention backend {backend}, ADAFLASH modes {modes}"
    )

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    work = out / "work"
    if args.model_path:
        if args.draft_path is None:
            ap.error("--model-path needs --draft-path")
        target, source_draft = args.model_path, args.draft_path
    else:
        target, source_draft = embedded_pair()
    home = work / "home"
    draft = adopt_drafter(home, source_draft, target)
    fleet_file = work / "fleet-drafter-version"
    fleet_file.write_text(draft.name + "\n")
    batch = prompts(target, args.requests)
    max_new = args.max_new_tokens

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ADAFLASH_")}

    def ada_env(mode: str) -> dict[str, str]:
        return dict(
            base_env,
            ADAFLASH_VERIFY_MODE=mode,
            ADAFLASH_HOME=str(home),
            ADAFLASH_FLEET_VERSION_FILE=str(fleet_file),
            ADAFLASH_RELOAD_POLL_S="1",
            ADAFLASH_LOADED_VERSION_FILE=str(work / f"loaded-{mode}.json"),
            ADAFLASH_ADMIN_OVERRIDE_FILE=str(work / f"override-{mode}"),
        )

    configs = [
        (name, server_args, ada_env(mode) if mode else base_env)
        for name, server_args, mode in server_configs(
            target, draft, backend, modes, args.mem_fraction_static, args.dspark_draft_path
        )
    ]
    reload_on = f"adaflash-{modes[0]}" if modes else None

    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "capability": list(capability),
        "attention_backend": backend,
        "compact_skipped": no_compact,
        "pair": {"target": str(target), "draft": str(source_draft)},
        "checks": [],
        "throughput": {},
    }
    outputs: dict[str, list[list[int]]] = {}

    def run_server(name, server_args, env, deterministic):
        tag = f"{name}{'-det' if deterministic else ''}"
        extra = ["--enable-deterministic-inference"] if deterministic else []
        server = Server(tag, server_args + extra, env, out / "logs")
        try:
            server.wait_ready(args.startup_timeout)
            if name.startswith("adaflash-"):
                mode = name.split("-", 1)[1]
                said = f"verify mode {mode}" in server.log_text()
                results["checks"].append({"check": f"{tag}_runs_in_{mode}_mode", "ok": said})
            if deterministic:
                outputs[name] = generate_all(server, batch, max_new)
                if name != "plain":
                    results["checks"].append(check_equal(name, outputs[name], outputs["plain"]))
                    results["checks"].append(sampled_smoke(name, server, batch[:16], max_new))
                if name == reload_on:
                    results["checks"].append(
                        hot_reload_under_load(
                            server, home, draft, fleet_file, batch, max_new, args.reload_timeout
                        )
                    )
                    after = generate_all(server, batch[:16], max_new)
                    results["checks"].append(
                        check_equal(f"{name}_after_reload", after, outputs["plain"][:16])
                    )
                    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
                        metrics = r.read().decode()
                    (out / f"{tag}-metrics.txt").write_text(metrics)
                    results["checks"].append(compaction_evidence(name, metrics))
                    results["checks"].append(
                        {
                            "check": "adaflash_metrics_exported",
                            "ok": (
                                "adaflash_spec_drafts_total" in metrics
                                and "adaflash_drafter_info" in metrics
                            ),
                        }
                    )
            else:
                results["throughput"][name] = [
                    run_load(server, batch, c, max_new) for c in CONCURRENCY
                ]
                for row in results["throughput"][name]:
                    log(f"{name} concurrency {row['concurrency']}: {row['tokens_per_s']:.1f} tok/s")
        except Exception as e:
            log(f"{tag} failed: {e!r}")
            results["checks"].append(
                {"check": f"{tag}_run", "ok": False, "error": repr(e), "log": str(server.log_path)}
            )
        finally:
            server.stop()

    for name, server_args, env in configs:
        if name != "dspark":  # DSPARK's outputs are checked by SGLang's own tests
            run_server(name, server_args, env, deterministic=True)
    if not args.skip_throughput:
        for name, server_args, env in configs:
            if name != "plain":
                run_server(name, server_args, env, deterministic=False)
        results["ratios"] = ratio_table(results["throughput"])
        for row in results["ratios"]:
            log(
                f"{row['adaflash']} / {row['vs']} at concurrency {row['concurrency']}: {row['ratio']:.3f}"
            )
    failed = [c["check"] for c in results["checks"] if not c["ok"]]
    results["ok"] = not failed and "plain" in outputs
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out / "results.json")
    log(f"{'PASSED' if results['ok'] else 'FAILED ' + ', '.join(failed)}: {out / 'results.json'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
