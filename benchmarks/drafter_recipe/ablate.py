"""Ablation of the offline drafter recipe: short training runs side by side on one frozen data set.

    python benchmarks/drafter_recipe/ablate.py --target DIR --train regen.train.jsonl \
        --heldout regen.heldout.jsonl --work runs/ablate --steps 500 --per-domain 1200 \
        --variant base --variant kd:kd_weight=0.5 --variant l5:target_layer_ids=1,3,5 \
        --out benchmarks/drafter_recipe/ablation.json

Every variant starts from the same seed and sees the same batches (the recipe draws batches and
anchors from (seed, step)); only the named settings differ from DrafterTrainConfig's defaults
(plus --steps and the overrides given to every variant with --common). Each is measured by the
teacher-forced block tau (training_job.dflash_offline.evaluate_blocks: one block at 4 random
anchors of each held-out regenerated response, the same anchors for every variant) per domain.
Runs resume (each variant's work directory keeps its checkpoint), so a killed ablation is
continued by running the same command again.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from training_job import dflash_offline as dfo  # noqa: E402
from training_job.data.common import atomic_write_text, read_jsonl  # noqa: E402


def parse_setting(cfg: dfo.DrafterTrainConfig, item: str) -> dfo.DrafterTrainConfig:
    key, _, raw = item.partition("=")
    kinds = {f.name: f.type for f in fields(cfg)}
    if key not in kinds:
        raise SystemExit(f"unknown setting {key!r}; one of {sorted(kinds)}")
    cur = getattr(cfg, key)
    if isinstance(cur, list) or key == "target_layer_ids":
        val = [int(x) for x in raw.split(",")]
    elif isinstance(cur, bool):
        val = raw.lower() in ("1", "true", "yes")
    elif isinstance(cur, int) or key == "intermediate_size":
        val = int(raw)
    elif isinstance(cur, float):
        val = float(raw)
    else:
        val = raw
    return replace(cfg, **{key: val})


def sample_per_domain(seqs: list[dict], n: int, seed: int = 0) -> list[dict]:
    """A seeded random sample of n records per domain, shuffled together (the same for every
    variant and every rerun)."""
    rng = random.Random(seed)
    out: list[dict] = []
    for domain in sorted({s["domain"] for s in seqs}):
        pool = [s for s in seqs if s["domain"] == domain]
        out += rng.sample(pool, min(n, len(pool)))
    rng.shuffle(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--train", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME[:key=value[:key=value...]]")
    ap.add_argument("--common", action="append", default=[], help="key=value for every variant")
    ap.add_argument("--per-domain", type=int, default=None,
                    help="train on a seeded random sample of this many records per domain")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(args.target))
    seqs = list(read_jsonl(args.train))
    if args.per_domain is not None:
        seqs = sample_per_domain(seqs, args.per_domain)
    heldout = list(read_jsonl(args.heldout))
    results = json.loads(args.out.read_text()) if args.out.exists() else {"variants": {}}
    results.update({"steps": args.steps, "train_records": len(seqs), "common": args.common,
                    "command": " ".join(["python", "benchmarks/drafter_recipe/ablate.py"]
                                        + (argv or sys.argv[1:]))})
    for spec in args.variant:
        name, *items = spec.split(":")
        cfg = replace(dfo.DrafterTrainConfig(), max_steps=args.steps, threads=args.threads)
        for item in args.common + items:
            cfg = parse_setting(cfg, item)
        t0 = time.time()
        drafter, stats = dfo.train_drafter(target, tok, seqs, cfg, args.work / name, progress=False)
        drafter.eval()
        tau = {d: round(dfo.evaluate_blocks(target, tok, drafter,
                                            [s for s in heldout if s["domain"] == d], cfg)["tau_mean"], 3)
               for d in sorted({s["domain"] for s in heldout})}
        results["variants"][name] = {"settings": items, "tau": tau, "final_loss": stats["final_loss"],
                                     "train_seconds": round(time.time() - t0, 1)}
        print(name, json.dumps(results["variants"][name]), flush=True)
        atomic_write_text(args.out, json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
