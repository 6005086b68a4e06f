"""Did the math rounds make the drafter forget code and prose? Each published version of one or
more kept demo volumes (``adaflash demo --home DIR``), measured on code and prose prompts the demo
never sent.

The demo's first phase sends the first shipped held-out prompts of code and prose, and its last
phase sends them again; the rounds train on them (and, with replay, train on them again), so the
live figures of that last phase are partly in-sample. This script takes the held-out prompts
from ``--offset`` on (default 100, far past the demo's 16 of each), so it measures what the
drafter does on code and prose it has not seen: tau (committed tokens per decode step), mode
``dflash`` (whole blocks: the length head plays no part), greedy, 64 new tokens, float32, with
the reference engine (``benchmarks/opd/run.py``'s evaluation).

    python benchmarks/closed_loop/forgetting.py --volume replay=<home> --volume no-replay=<home> \
        --out benchmarks/closed_loop/forgetting.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks" / "opd"))

from run import WORKLOADS, evaluate, prompt_ids, tokenizer  # noqa: E402

DOMAINS = ("code", "prose")


def unseen(tok, domain: str, offset: int, n: int):
    """Held-out prompts ``offset .. offset + n - 1`` of a domain, as evaluation samples."""
    from training_job.opd.traffic import Sample

    lines = [json.loads(x) for x in open(WORKLOADS / f"{domain}.heldout.jsonl") if x.strip()]
    if len(lines) < offset + n:
        raise SystemExit(f"{domain} has {len(lines)} held-out prompts: lower --offset or --prompts")
    return [Sample(key=r["id"], source="heldout", writer="-", id=r["id"], domain=domain,
                   prompt_ids=prompt_ids(tok, r["prompt"]), output_ids=[0] * 64)
            for r in lines[offset:offset + n]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--volume", action="append", required=True, metavar="LABEL=DIR",
                    help="a kept demo volume (repeatable); every version under drafters/ is measured")
    ap.add_argument("--offset", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=32, help="per domain")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = tokenizer()
    samples = [s for d in DOMAINS for s in unseen(tok, d, args.offset, args.prompts)]
    results = {}
    for spec in args.volume:
        label, _, home = spec.partition("=")
        versions = sorted(p.name for p in (Path(home) / "drafters").iterdir()
                          if p.name.startswith("v") and p.is_dir())
        results[label] = {}
        for v in versions:
            res = evaluate(Path(home) / "drafters" / v, samples, args.threads)
            results[label][v] = {"tau": res["tau"], "steps": res["steps"], "tokens": res["tokens"]}
            print(label, v, res["tau"], flush=True)
    out = {"command": "benchmarks/closed_loop/forgetting.py " + " ".join(
               f"--volume {s.partition('=')[0]}=<home>" for s in args.volume)
               + f" --offset {args.offset} --prompts {args.prompts}",
           "prompts": {d: [s.id for s in samples if s.domain == d] for d in DOMAINS},
           "results": results}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
