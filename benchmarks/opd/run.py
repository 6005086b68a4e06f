"""OPD against OSD on the embedded pair under a deployment shift to math.

The shipped drafter was trained on code and prose only and accepts almost nothing on math
(docs/models.md). Here the deployment's live traffic is math: waves of 128 word problems the
embedded target answers greedily through the reference engine (`adaflash generate
--traffic-dir`). After each wave one distillation round runs (`python -m training_job.distill`,
the operator's job, default settings: 2 epochs, lr 3e-4, alpha 0.8, tau 0.01) and publishes the
next version. Two arms see the same traffic: OPD (the default loss) and OSD (`--algorithm osd`,
plain CE). Greedy decoding is lossless, so the traffic does not depend on which drafter served
it, and each wave is generated once and shown to both arms.

After every round each version is measured on the shipped held-out prompts of all three domains
(math: the shift; code and prose: what the drafter knew, to see what it forgets), through the
reference engine in mode dflash, greedy, 64 new tokens: tau = committed tokens per decode step.

    nice -n 5 python benchmarks/opd/run.py --out benchmarks/opd/results.json

Writes results.json (every figure, the job reports, settings, timings) and prints each round.
Intermediate files (the volumes, the traffic) go to --work (default .cache/opd-bench). The
script and the jobs it starts import the code next to it, so on a checkout others are editing,
run it from an export of one commit (benchmarks/opd/README.md shows how).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ASSETS = ROOT / "sglang_adaflash" / "assets"
TARGET = ASSETS / "models" / "target"
DRAFTER = ASSETS / "models" / "drafter"
WORKLOADS = ASSETS / "workloads"


def live_math_prompts(path: Path, n: int, seed: int) -> Path:
    """`n` math word problems that are not among the shipped held-out ones."""
    from training_job.data.math_problems import generate

    held = {json.loads(line)["prompt"] for line in open(WORKLOADS / "math.heldout.jsonl")}
    problems = generate(n, seed=seed, exclude=held)
    with open(path, "w") as f:
        for i, p in enumerate(problems):
            f.write(json.dumps({"id": f"live-{i:05d}", "domain": "math",
                                "prompt": p.question}) + "\n")
    return path


def heldout(domain: str, n: int):
    """The first `n` shipped held-out prompts of a domain, as evaluation samples."""
    from transformers import AutoTokenizer

    from sglang_adaflash.assets.chat_format import render_prompt
    from training_job.opd.traffic import Sample

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    out = []
    for i, line in enumerate(open(WORKLOADS / f"{domain}.heldout.jsonl")):
        if i >= n:
            break
        rec = json.loads(line)
        ids = tok(render_prompt(rec["prompt"]), add_special_tokens=False)["input_ids"]
        out.append(Sample(key=rec["id"], source="heldout", writer="-", id=rec["id"],
                          domain=domain, prompt_ids=ids, output_ids=[0] * 64))
    return out


def evaluate(version_dir: Path, samples, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_adaflash.drafter.checkpoint import load_drafter
    from training_job.distill import stop_ids_and_pad
    from training_job.opd.evaluate import engine_tau

    torch.set_num_threads(threads)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    stops, _ = stop_ids_and_pad(TARGET, target)
    drafter = load_drafter(version_dir, dtype=torch.float32)
    t0 = time.time()
    res = engine_tau(target, drafter, samples, max_new_tokens=64, batch_size=16, stop_ids=stops)
    return {"tau": {d: round(v["tau"], 3) for d, v in res.items()},
            "steps": {d: v["steps"] for d, v in res.items()},
            "tokens": {d: v["tokens"] for d, v in res.items()},
            "seconds": round(time.time() - t0, 1)}


def run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}; see {log}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/opd/results.json")
    ap.add_argument("--work", default=".cache/opd-bench")
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--wave-size", type=int, default=128)
    ap.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts per domain")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--commit", default=None,
                    help="the commit this code was exported from (when run outside a checkout)")
    args = ap.parse_args()

    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_checkpoint

    work = ROOT / args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = work / "log.txt"
    py = sys.executable
    started = time.time()
    env_threads = {"OMP_WAIT_POLICY": "PASSIVE"}
    os.environ.update(env_threads)

    # 1. The live traffic, wave by wave (the same for both arms).
    prompts = live_math_prompts(work / "live.jsonl", args.waves * args.wave_size, args.seed)
    lines = prompts.read_text().splitlines()
    t0 = time.time()
    for w in range(args.waves):
        part = work / f"wave{w}.jsonl"
        part.write_text("\n".join(lines[w * args.wave_size:(w + 1) * args.wave_size]) + "\n")
        run([py, "-m", "sglang_adaflash.cli.main", "generate", "--target", str(TARGET),
             "--drafter", str(DRAFTER), "--mode", "dflash", "--dtype", "float32",
             "--prompts", str(part), "--max-new-tokens", "128", "--max-batch-size", "32",
             "--json", "--quiet", "--traffic-dir", str(work / "traffic" / "traffic" / f"wave{w}")],
            log)
    traffic_s = time.time() - t0

    # 2. Two volumes that start from the shipped drafter as v000001.
    arms = {"opd": [], "osd": ["--algorithm", "osd"]}
    for arm in arms:
        publish_checkpoint(work / arm, DRAFTER, target=target_fingerprint(TARGET),
                           training={"algorithm": "dflash-offline (shipped)"})

    samples = [s for d in ("math", "code", "prose") for s in heldout(d, args.eval_prompts)]
    results = {"parent": evaluate(work / "opd" / "drafters" / "v000001", samples, args.threads),
               "rounds": []}
    print(f"parent v000001: {results['parent']['tau']}", flush=True)

    # 3. Rounds: reveal a wave, distil, evaluate.
    for w in range(args.waves):
        shutil.copytree(work / "traffic" / "traffic" / f"wave{w}",
                        work / "opd" / "traffic" / f"wave{w}")
        shutil.copytree(work / "traffic" / "traffic" / f"wave{w}",
                        work / "osd" / "traffic" / f"wave{w}")
        row = {"wave": w + 1}
        for arm, extra in arms.items():
            report = work / f"report-{arm}-{w + 1}.json"
            t0 = time.time()
            # the target as a path relative to the checkout: the report records it as given
            run([py, "-m", "training_job.distill", "--home", str(work / arm), "--target",
                 str(TARGET.relative_to(ROOT)), "--min-records", str(args.wave_size), "--report", str(report),
                 "--threads", str(args.threads), "--quiet", *extra], log)
            rep = json.loads(report.read_text())
            ev = evaluate(work / arm / "drafters" / rep["version"], samples, args.threads)
            row[arm] = {"version": rep["version"], "report": rep, "heldout": ev,
                        "round_seconds": round(time.time() - t0 - ev["seconds"], 1)}
            print(f"wave {w + 1} {arm} {rep['version']}: held-out {ev['tau']}, job eval "
                  f"{rep.get('eval')}", flush=True)
        results["rounds"].append(row)

    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results["settings"] = {
        "command": "nice -n 5 python benchmarks/opd/run.py " + " ".join(sys.argv[1:]),
        "waves": args.waves, "wave_size": args.wave_size, "eval_prompts": args.eval_prompts,
        "eval": "reference engine, mode dflash, greedy, 64 new tokens, float32, batch 16",
        "job": "python -m training_job.distill defaults (2 epochs, lr 3e-4, alpha 0.8, "
               "tau 0.01, batch 8, 24 anchors, head 50 steps)",
        "traffic": f"math word problems (seed {args.seed}, not in the held-out set), greedy, "
                   f"128 new tokens, generated in {traffic_s:.0f} s",
        "git": args.commit or git.stdout.strip(), "python": platform.python_version(),
        "machine": platform.machine(), "threads": args.threads,
        "seconds": round(time.time() - started),
    }
    out = ROOT / args.out
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
