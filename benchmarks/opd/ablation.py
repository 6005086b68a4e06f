"""The OPD objective, ablated: the AdaFlash reference's settings against ours, one at a time.

The distillation job's defaults are the reference's (``training_job.opd.loss`` and ``train``):
the KL term normalised by the decayed-weight sum with T^2, every sequence its own normalisation
group, AdamW (0.9, 0.999) with weight decay 0.01, the length head trained in the same steps on
the drafter's detached states. Each other arm changes one of them to this project's earlier
choice; ``previous`` changes all of them. Every arm trains the shipped drafter on the same shift
round (math-heavy traffic the drafter has never seen, answered by the embedded target) for the
same steps, with several seeds (the job's ``--seed``: batch order and anchors), then is measured
on the shipped held-out prompts of every domain (run.py's evaluation: tau, mode dflash, greedy,
64 new tokens; the length head read at every drafted step).

    nice -n 5 python benchmarks/opd/ablation.py --data .cache/opd-data \\
        --out benchmarks/opd/ablation.json

The training, the head refit and the recalibration are the job's own functions, called in one
process so the target loads once; the round's held-out slice is chosen by the job's rule and
used, as in the job, for the recalibration only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import (  # noqa: E402 - the benchmark's own helpers, next to this file
    DOMAINS,
    DRAFTER,
    ROOT,
    TARGET,
    build_data,
    evaluate,
    fresh_work,
    heldout,
    live_prompts,
    run,
    tokenizer,
)

#: Each arm: the job's options it changes (command-line spelling, as a user would reproduce it).
ARMS = {
    "reference": [],
    "count-norm": ["--norm", "count", "--no-t-squared"],
    "batch-scope": ["--scope", "batch"],
    "adam-0.95": ["--adam-beta2", "0.95", "--weight-decay", "0"],
    "head-refit": ["--head", "refit"],
    "previous": ["--norm", "count", "--no-t-squared", "--scope", "batch", "--adam-beta2",
                 "0.95", "--weight-decay", "0", "--head", "refit"],
}


def job_config(flags: list[str], seed: int, epochs: int):
    """The OPDConfig the job builds from its command line with ``flags`` (and a dummy
    --target), so an arm here is exactly what ``python -m training_job.distill`` would train."""
    from training_job.opd.options import build_parser, opd_config

    args = build_parser().parse_args(["--target", "-", "--seed", str(seed), "--epochs",
                                      str(epochs), *flags])
    return opd_config(args)


def round_samples(home: Path):
    """The round's train and held-out records, by the job's selection rule and defaults."""
    from sglang_adaflash.serving.traffic import ReadReport
    from training_job.opd.traffic import scan_traffic, select_round

    sel = select_round(scan_traffic(home, ReadReport()), set(), max_records=4096,
                       eval_fraction=0.1, min_eval=8, max_eval=64)
    return sel.train, sel.eval


def train_arm(target, pad: int, train, held, cfg, work: Path, out_dir: Path) -> dict:
    """The job's training, head and recalibration on the shipped drafter; writes it to
    ``out_dir`` (a checkpoint the evaluation loads)."""
    import torch

    from sglang_adaflash.drafter.checkpoint import load_drafter, write_checkpoint
    from training_job.opd.calibrate import calibrate_head
    from training_job.opd.train import clip_sequence, train_head, train_opd

    drafter = load_drafter(DRAFTER, dtype=torch.float32)
    steps: list[dict] = []
    t0 = time.time()
    seqs = [s.as_sequence() for s in train]
    stats = train_opd(target, drafter, seqs, cfg, work, pad_id=pad, log=steps.append)
    head = stats.pop("length_head", None) or train_head(target, drafter, seqs, cfg, work,
                                                        pad_id=pad)
    head["calibration"] = calibrate_head(
        target, drafter, [clip_sequence(s.as_sequence(), cfg.max_seq_len) for s in held],
        pad_id=pad, anchors_per_seq=cfg.anchors_per_seq, batch_size=cfg.batch_size, seed=cfg.seed)
    seconds = time.time() - t0
    write_checkpoint(out_dir, drafter.config,
                     {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
                     overwrite=True)
    per_epoch = max(1, len(steps) // cfg.epochs)
    return {"steps": stats["steps"], "first_loss": round(stats["first_loss"], 4),
            "final_loss": round(stats["final_loss"], 4),
            "clipped_entries": sum(s["clipped"] for s in steps),
            "clipped_first_epoch": sum(s["clipped"] for s in steps[:per_epoch]),
            "head": {k: head[k] for k in ("mode", "steps", "final_mse") if k in head},
            "calibration_applied": head["calibration"].get("applied"),
            "train_seconds": round(seconds, 1)}


def summarise(results: dict) -> dict:
    """Per arm: mean and sd over seeds of every domain's tau, and the paired difference to the
    reference (same seed: same batches and anchors) with its standard error."""
    out = {}
    ref = results["reference"]
    for arm, by_seed in results.items():
        seeds = sorted(by_seed)
        row = {}
        for d in DOMAINS:
            xs = [by_seed[s]["heldout"]["tau"][d] for s in seeds]
            diffs = [by_seed[s]["heldout"]["tau"][d] - ref[s]["heldout"]["tau"][d]
                     for s in seeds if s in ref]
            row[d] = {"mean": round(_mean(xs), 3), "sd": round(_sd(xs), 3),
                      "diff_vs_reference": round(_mean(diffs), 3) if diffs else None,
                      "diff_se": round(_sd(diffs) / math.sqrt(len(diffs)), 3) if diffs else None}
        head = [by_seed[s]["heldout"]["length_head"].get("math", {}) for s in seeds]
        row["head_math_pearson"] = round(_mean([h.get("pearson") or 0.0 for h in head]), 3)
        row["head_math_mae"] = round(_mean([h.get("mae", 0.0) for h in head]), 4)
        row["clipped_first_epoch"] = [by_seed[s]["training"]["clipped_first_epoch"]
                                      for s in seeds]
        out[arm] = row
    return out


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs):
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/opd/ablation.json")
    ap.add_argument("--work", default=".cache/opd-ablation")
    ap.add_argument("--data", default=None, help="built workloads (python -m training_job.data "
                                                 "build); default: built into --work")
    ap.add_argument("--math", type=int, default=120, help="math prompts in the round")
    ap.add_argument("--code", type=int, default=20, help="code prompts in the round")
    ap.add_argument("--prose", type=int, default=20, help="prose prompts in the round")
    ap.add_argument("--seeds", default="0,1,2", help="the job's --seed of each repeat")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per domain")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2027, help="of the traffic's prompts")
    ap.add_argument("--commit", default=None,
                    help="the commit this code was exported from (when run outside a checkout)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    work, log, started = fresh_work(args.work)
    torch.set_num_threads(args.threads)

    # 1. One shift round of traffic, answered by the target.
    data = build_data(Path(args.data) if args.data else work / "data", log)
    per = {"math": args.math, "code": args.code, "prose": args.prose}
    (batch,), prompt_stats = live_prompts(data, 1, per, 512 - 128 - 8, args.seed)
    part = work / "round.jsonl"
    part.write_text("".join(json.dumps(p) + "\n" for p in batch))
    home = work / "home"
    t0 = time.time()
    run([sys.executable, "-m", "sglang_adaflash.cli.main", "generate", "--target", str(TARGET),
         "--drafter", str(DRAFTER), "--mode", "dflash", "--dtype", "float32", "--prompts",
         str(part), "--max-new-tokens", "128", "--max-batch-size", "96", "--json", "--quiet",
         "--traffic-dir", str(home / "traffic" / "round1")], log)
    traffic_s = time.time() - t0
    train, held = round_samples(home)
    print(f"traffic: {len(train)} records to train on, {len(held)} held out ({traffic_s:.0f} s)",
          flush=True)

    # 2. The arms.
    from training_job.opd.round import stop_ids_and_pad

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    _, pad = stop_ids_and_pad(TARGET, target)
    samples = [s for d in DOMAINS for s in heldout(tokenizer(), d, args.eval_prompts)]
    results: dict[str, dict] = {"shipped": {"-": {"heldout": evaluate(DRAFTER, samples,
                                                                      args.threads)}}}
    print(f"shipped drafter: {results['shipped']['-']['heldout']['tau']}", flush=True)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    arms = [a for a in args.arms.split(",") if a]
    for seed in seeds:
        for arm in arms:
            cfg = job_config(ARMS[arm], seed, args.epochs)
            out_dir = work / "drafters" / f"{arm}-{seed}"
            training = train_arm(target, pad, train, held, cfg, work / f"w-{arm}-{seed}",
                                 out_dir)
            ev = evaluate(out_dir, samples, args.threads)
            results.setdefault(arm, {})[str(seed)] = {"training": training, "heldout": ev}
            print(f"{arm} seed {seed}: tau {ev['tau']}, clipped {training['clipped_entries']}, "
                  f"{training['train_seconds']} s", flush=True)
            shutil.rmtree(work / f"w-{arm}-{seed}", ignore_errors=True)
            write(args, results, prompt_stats, traffic_s, started, len(train), len(held))
    write(args, results, prompt_stats, traffic_s, started, len(train), len(held))
    return 0


def write(args, results, prompt_stats, traffic_s, started, n_train, n_held) -> None:
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    arms = {k: v for k, v in results.items() if k != "shipped"}
    doc = {
        "settings": {
            "command": "nice -n 5 python benchmarks/opd/ablation.py " + " ".join(sys.argv[1:]),
            "round": {"math": args.math, "code": args.code, "prose": args.prose,
                      "train_records": n_train, "heldout_records": n_held,
                      "prompt_seed": args.seed, "prompts": prompt_stats,
                      "traffic": f"greedy, 128 new tokens, generated in {traffic_s:.0f} s"},
            "arms": {a: ARMS[a] for a in arms}, "seeds": args.seeds, "epochs": args.epochs,
            "eval": f"shipped held-out prompts, first {args.eval_prompts} per domain, mode "
                    "dflash, greedy, 64 new tokens, float32",
            "git": args.commit or git.stdout.strip(), "python": platform.python_version(),
            "threads": args.threads, "seconds": round(time.time() - started),
        },
        "shipped": results["shipped"]["-"]["heldout"],
        "summary": summarise(arms) if "reference" in arms else {},
        "arms": arms,
    }
    out = ROOT / args.out
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(main())
