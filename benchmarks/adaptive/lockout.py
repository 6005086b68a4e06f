"""Whether a burst of load during drafting locks the reference engine out of drafting.

The engine's drafting price is refitted only from steps that draft (planner.cost.OnlineCostModel),
and a probe is paid at that price out of a credit that grows by a share of a plain step's cost
(engine.draft_choice). This serves the in-domain held-out prompts (code and prose alternating,
chat-formatted, 64 new tokens, T=0) one after another at c=1 on the shipped pair, twice on fresh
engines: as they are, and with `--burst` drafted steps fed to the cost model after the first
request at `--factor` times the drafting price the fit then holds (what a burst of load on a
shared machine makes the engine observe). It records each request's drafted share of steps.

    python benchmarks/adaptive/lockout.py --out benchmarks/adaptive/lockout.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))

from run import workloads  # noqa: E402

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.machine import cpu_description  # noqa: E402
from sglang_adaflash.bench.runner import recorded_path  # noqa: E402
from sglang_adaflash.core.sampling import SamplingParams  # noqa: E402
from sglang_adaflash.engine.engine import SpecEngine  # noqa: E402
from sglang_adaflash.engine.request import Request  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.launch.prompts import resolve_prompt_ids  # noqa: E402


def prompts(pair, per_domain: int) -> list[tuple[str, list[int]]]:
    """run.py's in-domain workload, in its order (code and prose alternating): (domain, ids)."""
    return [(s.domain, resolve_prompt_ids(s, pair.tokenizer)) for s in workloads(per_domain)["in_domain"]]


def serve(pair, requests, burst: int, factor: float) -> dict:
    eng = SpecEngine(pair.target, pair.drafter, mode="adaflash", max_batch_size=4, max_seq_len=512, seed=0)
    shares, price = [], None
    for k, (domain, ids) in enumerate(requests):
        if k == 1 and burst:
            cost = eng._online_cost.model(1)
            price = cost.draft_fixed + cost.per_draft
            for _ in range(burst):  # one request drafted, 7 proposals, the verify at its fitted price
                verify = cost.fixed + cost.per_token * 8 - cost.per_proposal
                eng._online_cost.observe(1, 8, verify, drafted=1, draft_seconds=factor * price, proposals=7)
        sampling = SamplingParams(max_new_tokens=64, stop_token_ids=list(pair.stop_token_ids))
        out = eng.run([Request(ids, sampling, domain=domain)])[0]
        shares.append(round(sum(out.stats.drafted) / max(len(out.stats.drafted), 1), 3))
    after = eng._online_cost.model(1)
    return {"burst": burst, "factor": factor, "drafting_price_before_burst_s": price,
            "drafting_price_at_end_s": after.draft_fixed + after.per_draft,
            "drafted_share_per_request": shares,
            "drafted_share_after_first": round(sum(shares[1:]) / max(len(shares) - 1, 1), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-domain", type=int, default=16)
    ap.add_argument("--burst", type=int, default=12, help="drafted steps observed at the inflated price")
    ap.add_argument("--factor", type=float, default=4.0, help="how many times the fitted drafting price")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    requests = prompts(pair, args.per_domain)
    runs = [serve(pair, requests, 0, args.factor), serve(pair, requests, args.burst, args.factor)]
    for r in runs:
        print(f"burst {r['burst']:2d}: drafted share after the first request {r['drafted_share_after_first']:.3f} "
              f"{r['drafted_share_per_request']}")
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:  # no machine's absolute path in the record
        given[given.index("--out") + 1] = recorded_path(args.out)
    out = {"command": "benchmarks/adaptive/lockout.py " + " ".join(given),
           "machine": cpu_description(), "runs": runs}
    if args.out:
        write_text_atomic(args.out, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
