"""Offline evaluation of recovery drafters side by side, at the first drafter's real failures.

For each named recovery checkpoint, `training_job.d2sd_recovery.evaluate` with the shipped first
drafter: the accepted continuation after a true prefix, and at the first drafter's first wrong
slot in a block how often the recovery drafter's best token other than the chain's is right
(top-1, top-4), beside the first drafter's own next-ranked tokens there. Same held-out
responses, same anchors (one seed) for every checkpoint, so the rows compare directly.

    python -m training_job.models regen --out BUILD --target sglang_adaflash/assets/models/target
    python benchmarks/d2sd/recovery_eval.py --data BUILD/regen.heldout.jsonl \\
        --recovery shipped=sglang_adaflash/assets/models/recovery_drafter \\
        --recovery init=sglang_adaflash/assets/models/drafter --out benchmarks/d2sd/recovery_eval.json

A checkpoint from an earlier commit is extracted first, e.g. `git archive <commit>
sglang_adaflash/assets/models/recovery_drafter | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_adaflash.assets import chat_format as cf  # noqa: E402
from training_job.d2sd_recovery import evaluate, load_init  # noqa: E402
from training_job.data.common import atomic_write_text, read_jsonl  # noqa: E402

MODELS = ROOT / "sglang_adaflash" / "assets" / "models"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, type=Path, help="held-out regenerated responses (JSONL)")
    ap.add_argument("--recovery", action="append", required=True, metavar="NAME=DIR",
                    help="a recovery drafter (or a plain drafter, read as its own initialisation); repeatable")
    ap.add_argument("--target", type=Path, default=MODELS / "target")
    ap.add_argument("--first", type=Path, default=MODELS / "drafter")
    ap.add_argument("--domains", default="code,prose")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    named = []
    for item in args.recovery:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_dir():
            ap.error(f"--recovery wants NAME=DIR with an existing directory, got {item!r}")
        named.append((name, Path(path)))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    mask_id = tokenizer.convert_tokens_to_ids(cf.MASK)

    def load(path):
        d = load_init(path, target, mask_id).eval()
        d.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
        return d

    first = load(args.first)
    domains = set(args.domains.split(","))
    seqs = [s for s in read_jsonl(args.data) if s.get("domain") in domains]
    layer_ids, b = list(first.config.target_layer_ids), first.config.block_size
    rows = {}
    for name, path in named:
        t0 = time.time()
        with torch.no_grad():
            rows[name] = evaluate(target, load(path), seqs, layer_ids, b, mask_id, tokenizer.pad_token_id,
                                  seed=args.seed, first=first)
        print(json.dumps({name: rows[name], "seconds": round(time.time() - t0, 1)}), flush=True)
    report = {
        "command": "python benchmarks/d2sd/recovery_eval.py " + " ".join(_portable(a) for a in (argv or sys.argv[1:])),
        "responses": len(seqs), "domains": sorted(domains), "seed": args.seed,
        "checkpoints": {name: _portable(str(path)) for name, path in named}, "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    return 0


def _portable(text: str) -> str:
    """Paths inside the repository relative to it; nothing names this machine."""
    return text.replace(str(ROOT) + "/", "")


if __name__ == "__main__":
    raise SystemExit(main())
