"""The shared volume the distillation-job tests start from: a tiny pair, v000001 published, and
on-policy traffic in both formats (the project's shards and SGLang's request log).

Built once per test module (conftest's ``base``); each test gets its own copy (``vol``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys

import torch

from sglang_adaflash.drafter.manifest import target_fingerprint
from sglang_adaflash.drafter.store import publish_checkpoint
from sglang_adaflash.serving.traffic import TrafficRecord, TrafficWriter
from sglang_adaflash.testing.tiny_pair import build_tiny_pair

N_TRAFFIC, N_SGLANG = 14, 10


def sglang_line(rid, prompt, output, domain):
    obj = {"timestamp": "2026-11-30T09:00:00", "event": "request.finished", "rid": rid,
           "obj": {"rid": rid, "input_ids": prompt,
                   "sampling_params": {"temperature": 0.0, "custom_params": {"domain": domain}}},
           "out": {"output_ids": output, "meta_info": {}}}
    return f"[2026-11-30 09:00:00] {json.dumps(obj)}\n"


def build_volume(root):
    """(pair, home): v000001 (the tiny pair's drafter) and 24 greedy responses of its target."""
    from transformers import AutoModelForCausalLM

    pair = build_tiny_pair(root / "pair", seed=0)
    home = root / "home"
    publish_checkpoint(home, pair.drafter_dir, target=target_fingerprint(pair.target_dir))
    target = AutoModelForCausalLM.from_pretrained(pair.target_dir).eval()
    rng = random.Random(0)
    records = []
    for i in range(N_TRAFFIC + N_SGLANG):
        prompt = [1, 4] + [rng.randrange(8, pair.vocab_size) for _ in range(rng.randint(3, 8))]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                  pad_token_id=0)
        records.append((prompt, gen[0, len(prompt):].tolist(), ("code", "math")[i % 2]))
    with TrafficWriter(home, "pod-a", max_records=5) as w:
        for i, (p, o, d) in enumerate(records[:N_TRAFFIC]):
            w.write(TrafficRecord(id=f"r{i}", model="tiny", drafter_version="v000001",
                                  prompt_ids=p, output_ids=o, sampling={"temperature": 0.0},
                                  accept_lens=[1] * len(o), finish_reason="length", domain=d,
                                  ts=1000.0 + i))
    logdir = home / "traffic" / "pod-b"
    logdir.mkdir(parents=True)
    with open(logdir / "host_0.log", "w") as f:
        for i, (p, o, d) in enumerate(records[N_TRAFFIC:]):
            f.write(sglang_line(f"s{i}", p, o, d))
    return pair, home


def write_batch(home, pair, batch: int, n: int, domains=("code", "math")) -> list[str]:
    """``n`` records from writer ``pod-<batch>`` (random prompts and outputs, domains in turn,
    timestamps after every earlier batch's); returns their ids."""
    rng = random.Random(batch)
    ids = []
    with TrafficWriter(home, f"pod-{batch}", max_records=n) as w:
        for i in range(n):
            prompt = [1, 4] + [rng.randrange(8, pair.vocab_size) for _ in range(5)]
            out = [rng.randrange(8, pair.vocab_size) for _ in range(10)]
            rid = f"b{batch}-{i}"
            w.write(TrafficRecord(id=rid, model="tiny", drafter_version="v000001",
                                  prompt_ids=prompt, output_ids=out,
                                  sampling={"temperature": 0.0}, accept_lens=[1] * len(out),
                                  finish_reason="length", domain=domains[i % len(domains)],
                                  ts=1000.0 * batch + i))
            ids.append(rid)
    return ids


def copy_volume(base, tmp_path):
    pair, home = base
    mine = tmp_path / "home"
    shutil.copytree(home, mine)
    return pair, mine


def job_argv(pair, home, report, *extra):
    return ["--home", str(home), "--target", str(pair.target_dir), "--parent", "v000001",
            "--min-records", "20", "--report", str(report), "--epochs", "2", "--batch-size", "4",
            "--anchors-per-seq", "4", "--head-steps", "2", "--ckpt-every", "2",
            "--eval-max-new-tokens", "6", "--min-eval-records", "4", "--max-eval-records", "4",
            "--threads", "1", "--quiet", *extra]


def job_launchers(ranks: int = 2) -> dict[str, list[str]]:
    """The job as one process ("one") and under torchrun with ``ranks`` processes ("many")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"one": [sys.executable, "-m", "training_job.distill"],
            "many": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                     str(ranks), "--master-port", str(port), "-m", "training_job.distill"]}


def run_job(launcher: list[str], pair, home, report, *extra, env: dict | None = None):
    """Run the job with ``launcher`` as a subprocess; (its report, v000002's weights)."""
    from safetensors.torch import load_file

    r = subprocess.run(launcher + job_argv(pair, home, report, *extra), capture_output=True,
                       text=True, timeout=900, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return (json.loads(report.read_text()),
            load_file(str(home / "drafters" / "v000002" / "model.safetensors")))


def assert_same_round(a, b, tol: float) -> None:
    """Two (report, weights) of the same round: same steps, loss and weights within ``tol``."""
    (ra, wa), (rb, wb) = a, b
    assert ra["training"]["steps"] == rb["training"]["steps"]
    assert abs(ra["training"]["finalLoss"] - rb["training"]["finalLoss"]) < max(tol, 1e-4)
    for k in wa:
        assert (wa[k].double() - wb[k].double()).abs().max() < tol, k
