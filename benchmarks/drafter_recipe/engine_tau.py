"""Drafters side by side through the reference engine: tau per domain and by response position.

    python benchmarks/drafter_recipe/engine_tau.py --drafter shipped=sglang_adaflash/assets/models/drafter \
        --drafter refined=runs/models/drafter_refined --prompts benchmarks/embedded_pair/all_domains_prompts.jsonl \
        --out benchmarks/drafter_recipe/stage2/engine_tau.json

Mode `dflash`, T=0, one request at a time, float32, 64 new tokens (the settings of the README's
tau row, `benchmarks/embedded_pair/all_domains`), every drafter on the same prompts with the
same target; every request's output is checked equal to plain greedy decoding (`ar`), so the
figures come from lossless runs. Besides tau per domain (committed tokens per verify step), each
step is put in a bin by where it starts in the response (0-15, 16-31, ... generated tokens):
where acceptance is lost. The drafter step's cost is `width_cost.py`'s business, not this one's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sglang_adaflash.core.sampling import SamplingParams  # noqa: E402
from sglang_adaflash.engine.engine import SpecEngine  # noqa: E402
from sglang_adaflash.engine.request import Request  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.launch.prompts import read_prompts, resolve_prompt_ids  # noqa: E402
from training_job.data.common import atomic_write_text  # noqa: E402

BIN = 16


def measure(target: Path, drafter: Path | None, prompts, max_new: int) -> dict:
    pair = load_pair(target, drafter, dtype="float32", need_drafter=drafter is not None)
    engine = SpecEngine(pair.target, pair.drafter, mode="dflash" if drafter else "ar",
                        max_batch_size=1, max_seq_len=1024)
    sp = SamplingParams(max_new_tokens=max_new, stop_token_ids=pair.stop_token_ids)
    outs = {}
    for spec in prompts:
        ids = resolve_prompt_ids(spec, pair.tokenizer)
        outs[spec.id] = (spec.domain or "all", engine.run([Request(ids, sp)])[0])
    return outs


def summarise(outs: dict) -> dict:
    by_domain: dict[str, list[int]] = {}
    by_pos: dict[str, dict[int, list[int]]] = {}
    for domain, o in outs.values():
        by_domain.setdefault(domain, []).extend(o.stats.accept_lens)
        pos = 1  # prefill's token comes first; the first verify step starts after it
        for a in o.stats.accept_lens:
            by_pos.setdefault(domain, {}).setdefault(pos // BIN, []).append(a)
            pos += a
    mean = lambda v: round(sum(v) / len(v), 4)  # noqa: E731
    return {
        "tau": {d: mean(v) for d, v in sorted(by_domain.items())},
        "steps": {d: len(v) for d, v in sorted(by_domain.items())},
        "tau_by_position": {d: {f"{BIN * b}-{BIN * b + BIN - 1}": {"tau": mean(v), "steps": len(v)}
                                for b, v in sorted(bins.items())} for d, bins in sorted(by_pos.items())},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("sglang_adaflash/assets/models/target"))
    ap.add_argument("--drafter", action="append", required=True, help="LABEL=DIR, repeatable")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = read_prompts(args.prompts)
    plain = measure(args.target, None, prompts, args.max_new_tokens)
    result = {"command": "python " + " ".join(["benchmarks/drafter_recipe/engine_tau.py"] + sys.argv[1:]),
              "config": {"prompts": str(args.prompts), "max_new_tokens": args.max_new_tokens,
                         "mode": "dflash", "temperature": 0, "dtype": "float32", "concurrency": 1,
                         "threads": args.threads},
              "drafters": {}}
    for item in args.drafter:
        label, _, path = item.partition("=")
        outs = measure(args.target, Path(path), prompts, args.max_new_tokens)
        unequal = [k for k, (_, o) in outs.items() if o.output_ids != plain[k][1].output_ids]
        if unequal:
            raise SystemExit(f"{label}: {len(unequal)} outputs differ from plain greedy decoding: {unequal[:3]}")
        result["drafters"][label] = {"path": Path(path).name, "equal_to_ar": True, **summarise(outs)}
        print(label, json.dumps(result["drafters"][label]["tau"]), flush=True)
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
