"""End-to-end check of ADAFLASH on a real GPU: one command, non-zero exit on any failed check.

    python -m sglang_adaflash.sglang_plugin.e2e --out e2e-results

What it proves, which the CPU test suite cannot:

1. **losslessness**: with temperature 0, DFLASH and ADAFLASH produce exactly the tokens of plain
   decoding, request by request;
2. **throughput**: output tokens per second at concurrency 1, 32 and 64 for plain decoding,
   DFLASH and ADAFLASH (ADAFLASH's ``/metrics`` are saved next to the results);
3. **hot reload under load**: while 32 concurrent requests run, a new drafter version is
   published and requested; the server must report it as loaded, no request may fail, and
   temperature-0 outputs must still equal plain decoding afterwards.

By default it builds a small random-weight pair locally (no download): a Qwen3-style target and
a DFlash drafter with a length head, published as ``v000001`` on a fresh ``ADAFLASH_HOME``. A
random drafter is almost never accepted, so the throughput numbers then only show overheads;
pass ``--model-path`` and ``--draft-path`` (a local DFlash/AdaFlash drafter directory) for a real
pair. Requests use token ids (``--skip-tokenizer-init``), so no tokenizer is needed.
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


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# The model pair
# ---------------------------------------------------------------------------------------------


def build_random_pair(root: Path, *, vocab: int, block_size: int, seed: int) -> tuple[Path, Path]:
    """A random Qwen3 target (HF format) and a published random drafter with a length head."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sglang_adaflash.drafter.config import DrafterConfig
    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_version

    target_dir = root / "target"
    torch.manual_seed(seed)
    layers = 8
    cfg = Qwen3Config(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=vocab - 2,
        bos_token_id=vocab - 3,
    )
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(target_dir)
    home = root / "home"
    draft_cfg = DrafterConfig.from_dict(
        dict(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=vocab,
            num_target_layers=layers,
            block_size=block_size,
            torch_dtype="bfloat16",
            dflash_config=dict(mask_token_id=vocab - 1, use_thresh_head_two_model=True),
        )
    )
    version = publish_version(
        home,
        draft_cfg,
        random_drafter_state(draft_cfg, seed + 1),
        target=target_fingerprint(target_dir),
    )
    return target_dir, home / "drafters" / version


def random_drafter_state(cfg, seed: int):
    import torch

    from sglang_adaflash.drafter.model import DFlashDrafter

    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).to(torch.bfloat16)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def publish_next(home: Path, current: Path, seed: int) -> str:
    """Publish the next version: new random weights for a random pair, else a copy."""
    from sglang_adaflash.drafter.checkpoint import read_checkpoint
    from sglang_adaflash.drafter.store import publish_version

    cfg, state = read_checkpoint(current)
    if os.environ.get("ADAFLASH_E2E_RANDOM_PAIR") == "1":
        state = random_drafter_state(cfg, seed)
    manifest = (
        json.loads((current / "manifest.json").read_text())
        if (current / "manifest.json").exists()
        else {}
    )
    return publish_version(
        home,
        cfg,
        state,
        target=manifest.get("target") or {"name": "unknown", "config_sha256": ""},
        parent=manifest.get("version"),
        training={"algorithm": "e2e-copy"},
    )


def adopt_drafter(home: Path, draft: Path) -> Path:
    """Publish a user's drafter as v000001 on a fresh ADAFLASH_HOME (so reload can follow)."""
    from sglang_adaflash.drafter.checkpoint import read_checkpoint
    from sglang_adaflash.drafter.store import publish_version

    cfg, state = read_checkpoint(draft, verify_manifest=False)
    version = publish_version(home, cfg, state, target={"name": "user-target", "config_sha256": ""})
    return home / "drafters" / version


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
    """One SGLang server in a subprocess, on 127.0.0.1, stopped on exit."""

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

    def generate(self, input_ids: list[int], max_new_tokens: int, temperature: float = 0.0):
        out = http_json(
            self.url + "/generate",
            {
                "input_ids": input_ids,
                "sampling_params": {
                    "temperature": temperature,
                    "max_new_tokens": max_new_tokens,
                    "ignore_eos": True,
                },
            },
        )
        return out["output_ids"], out.get("meta_info", {})


def prompts(n: int, vocab: int, seed: int, length: int = 48) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(0, vocab - 4) for _ in range(length)] for _ in range(n)]


def run_load(
    server: Server, batch: list[list[int]], concurrency: int, max_new: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: server.generate(p, max_new), batch))
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o, _ in outs)
    return {
        "concurrency": concurrency,
        "requests": len(batch),
        "output_tokens": tokens,
        "seconds": wall,
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


def hot_reload_under_load(
    server: Server, home: Path, draft: Path, desired_file: Path, batch, max_new, timeout
):
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
    for t in threads:
        t.start()
    time.sleep(5)
    new_version = publish_next(home, draft, seed=1234)
    desired_file.write_text(new_version + "\n")
    log(f"published {new_version} and asked for it under load")
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = http_json(server.url + "/adaflash/v1/drafter")
        if status.get("loaded_version") == new_version:
            break
        time.sleep(1)
    time.sleep(5)  # keep serving on the new weights for a while
    stop.set()
    for t in threads:
        t.join(timeout=600)
    ok = status.get("loaded_version") == new_version and not errors
    log(
        f"hot reload: loaded={status.get('loaded_version')} requests_done={done[0]} errors={len(errors)}"
    )
    return {
        "check": "hot_reload_under_load",
        "ok": ok,
        "new_version": new_version,
        "status": status,
        "requests_completed": done[0],
        "errors": errors[:10],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("e2e-results"))
    ap.add_argument("--model-path", help="target model directory (default: build a random pair)")
    ap.add_argument("--draft-path", type=Path, help="local DFlash/AdaFlash drafter directory")
    ap.add_argument("--attention-backend", default="fa3")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--reload-timeout", type=float, default=180)
    ap.add_argument("--mem-fraction-static", default="0.5")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args(argv)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    work = out / "work"
    if args.model_path:
        if args.draft_path is None:
            ap.error("--model-path needs --draft-path")
        target = Path(args.model_path)
        home = work / "home"
        draft = adopt_drafter(home, args.draft_path)
        vocab = args.vocab
    else:
        os.environ["ADAFLASH_E2E_RANDOM_PAIR"] = "1"
        target, draft = build_random_pair(
            work, vocab=args.vocab, block_size=args.block_size, seed=0
        )
        home = work / "home"
        vocab = args.vocab
    desired_file = work / "desired-drafter-version"
    desired_file.write_text(draft.name + "\n")

    base_env = dict(os.environ)
    base = [
        "--model-path",
        str(target),
        "--attention-backend",
        args.attention_backend,
        "--mem-fraction-static",
        args.mem_fraction_static,
    ]
    spec = ["--speculative-draft-model-path", str(draft)]
    ada_env = dict(
        base_env,
        ADAFLASH_HOME=str(home),
        ADAFLASH_FLEET_VERSION_FILE=str(desired_file),
        ADAFLASH_RELOAD_POLL_S="1",
        ADAFLASH_LOADED_VERSION_FILE=str(work / "status.json"),
        ADAFLASH_ADMIN_OVERRIDE_FILE=str(work / "override"),
    )
    configs = [
        ("plain", base, base_env),
        ("dflash", base + ["--speculative-algorithm", "DFLASH", *spec], base_env),
        ("adaflash", base + ["--speculative-algorithm", "ADAFLASH", *spec], ada_env),
    ]
    batch = prompts(args.requests, vocab, seed=7)
    results: dict[str, Any] = {
        "checks": [],
        "throughput": {},
        "pair": {"target": str(target), "draft": str(draft)},
    }
    outputs: dict[str, list[list[int]]] = {}
    failed = False
    for name, server_args, env in configs:
        server = Server(name, server_args, env, out / "logs")
        try:
            server.wait_ready(args.startup_timeout)
            with ThreadPoolExecutor(16) as pool:
                outputs[name] = [
                    o
                    for o, _ in pool.map(server.generate, batch, [args.max_new_tokens] * len(batch))
                ]
            if name != "plain":
                check = check_equal(name, outputs[name], outputs["plain"])
                results["checks"].append(check)
            if not args.skip_throughput:
                results["throughput"][name] = [
                    run_load(server, batch, c, args.max_new_tokens) for c in CONCURRENCY
                ]
                for row in results["throughput"][name]:
                    log(f"{name} concurrency {row['concurrency']}: {row['tokens_per_s']:.1f} tok/s")
            if name == "adaflash":
                results["checks"].append(
                    hot_reload_under_load(
                        server,
                        home,
                        draft,
                        desired_file,
                        batch,
                        args.max_new_tokens,
                        args.reload_timeout,
                    )
                )
                after = [server.generate(p, args.max_new_tokens)[0] for p in batch[:16]]
                results["checks"].append(
                    check_equal("adaflash_after_reload", after, outputs["plain"][:16])
                )
                try:
                    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
                        metrics = r.read().decode()
                    (out / "adaflash-metrics.txt").write_text(metrics)
                    has = (
                        "adaflash_spec_drafts_total" in metrics
                        and "adaflash_drafter_info" in metrics
                    )
                    results["checks"].append({"check": "adaflash_metrics_exported", "ok": has})
                except OSError as e:
                    results["checks"].append(
                        {"check": "adaflash_metrics_exported", "ok": False, "error": repr(e)}
                    )
        except Exception as e:
            log(f"{name} failed: {e!r}")
            results["checks"].append(
                {"check": f"{name}_run", "ok": False, "error": repr(e), "log": str(server.log_path)}
            )
        finally:
            server.stop()
    failed = any(not c["ok"] for c in results["checks"]) or len(outputs) < 3
    results["ok"] = not failed
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out / "results.json")
    log(f"{'PASSED' if not failed else 'FAILED'}: {out / 'results.json'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
