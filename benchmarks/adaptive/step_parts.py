"""Where a decode step's time goes in `ar`, `dflash` and `adaflash`, part by part.

Wraps the step's parts in CPU-time counters (time.process_time of this process: a few
microseconds each; with one torch thread, the process's own work whatever the other tenants of
the machine do) and serves the in-domain workload of benchmarks/adaptive/ (16 code + 16 prose
held-out prompts, T=0, 64 new tokens) at one concurrency, the modes interleaved over --repeats
rounds. Each part's figure is ms per decode step, the median over the rounds; nested parts are
inside their callers (listed in the output's note).

    python benchmarks/adaptive/step_parts.py --concurrency 1 --out benchmarks/adaptive/step_parts/c1.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.runner import recorded_path  # noqa: E402
from sglang_adaflash.core.rejection import RejectionSampler  # noqa: E402
from sglang_adaflash.engine import draft_choice, proposals  # noqa: E402
from sglang_adaflash.engine.engine import EngineStats, SpecEngine  # noqa: E402
from sglang_adaflash.engine.proposer import DFlashProposer  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.engine_factory import make_engine  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.launch.prompts import resolve_prompt_ids  # noqa: E402
from sglang_adaflash.planner.calibration import SurvivalPosterior  # noqa: E402
from sglang_adaflash.target.hf_target import HFTarget  # noqa: E402

# (owner, attribute, label): the parts timed
PARTS = [
    (SpecEngine, "_decode_step", "decode_step"),
    (SpecEngine, "_draft", "draft"),
    (SpecEngine, "_choose_drafted", "choose_drafted"),
    (SpecEngine, "_catch_up", "catch_up"),
    (DFlashProposer, "propose", "drafter_forward"),
    (SpecEngine, "_verify_lengths", "verify_lengths"),
    (SpecEngine, "_proposals", "proposals_lm_head"),
    (SpecEngine, "_verify_step", "verify_step"),
    (HFTarget, "forward", "target_forward"),
    (RejectionSampler, "verify", "accept"),
    (SpecEngine, "_update_context", "update_context"),
    (SpecEngine, "_commit", "commit"),
    (SpecEngine, "_retire", "retire"),
    (draft_choice, "plan_lengths", "choice_plan"),
    (draft_choice, "plan_on_host", "choice_plan_host"),
    (proposals, "plan_verify_lengths", "length_plan"),
    (SurvivalPosterior, "calibrate", "calibrate"),
    (SurvivalPosterior, "observe", "observe"),
]


def _instrument(totals: dict) -> None:
    for owner, name, label in PARTS:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.process_time()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] += time.process_time() - t0

        setattr(owner, name, timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--modes", default="ar,dflash,adaflash")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-domain", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", default=str(DRAFTER_DIR))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))
    from run import cell_requests, workloads  # the benchmark's own workload and requests

    pair = load_pair(TARGET_DIR, args.drafter, dtype="float32")
    prompts = [(resolve_prompt_ids(s, pair.tokenizer), s.domain) for s in workloads(args.per_domain)["in_domain"]]
    c = args.concurrency
    n = max(2 * c, len(prompts))
    max_seq = max(len(p) for p, _ in prompts) + args.max_new_tokens

    def requests():
        return cell_requests(prompts, n, args.max_new_tokens, tuple(pair.stop_token_ids))

    modes = args.modes.split(",")
    def engine(m):  # adaflash-head / adaflash-history pin the engine's lengths_from, as in run.py
        base, _, source = m.partition("-")
        extra = {"lengths_from": source} if source else {}
        return make_engine(pair, base, c, max_seq, 0, num_requests=n, **extra)

    engines = {m: engine(m) for m in modes}
    totals: dict[str, float] = defaultdict(float)
    _instrument(totals)
    for e in engines.values():
        e.run(requests()[:2])  # warm-up, and adaflash's cost profile
    runs: dict[str, list[dict]] = defaultdict(list)
    reference = None
    for rep in range(args.repeats):
        for m in modes[rep % len(modes):] + modes[: rep % len(modes)]:
            e = engines[m]
            totals.clear()
            e.stats = EngineStats()
            if e.posterior is not None:
                e.posterior = e.posterior.fresh()
            t0 = time.process_time()
            outs = e.run(requests())
            cpu = time.process_time() - t0
            ids = [o.output_ids for o in outs]
            if m == "ar":
                reference = ids
            elif reference is not None and ids != reference:
                print(f"T=0 MISMATCH in {m}", file=sys.stderr)
                return 1
            steps = e.stats.steps
            drafted = sum(sum(o.stats.drafted) for o in outs) if m.startswith("adaflash") else None
            row_steps = sum(o.stats.steps for o in outs)
            runs[m].append({"cpu_tokens_per_s": e.stats.committed_tokens / cpu,
                            "tau": sum(o.stats.committed_tokens for o in outs) / row_steps,
                            "mean_verify_len": sum(o.stats.verified_tokens for o in outs) / row_steps,
                            "drafted_share": None if drafted is None else drafted / row_steps,
                            "ms_per_step": cpu / steps * 1e3,
                            **{f"{k}_ms": v / steps * 1e3 for k, v in totals.items()}})
    result = {}
    for m, rs in runs.items():
        keys = sorted({k for r in rs for k in r})
        result[m] = {k: round(statistics.median(r[k] for r in rs if r.get(k) is not None), 4)
                     for k in keys if any(r.get(k) is not None for r in rs)}
    if "ar" in result:
        for m in result:
            result[m]["vs_ar"] = round(statistics.median(
                a["cpu_tokens_per_s"] / b["cpu_tokens_per_s"] for a, b in zip(runs[m], runs["ar"])), 3)
    report = {"command": "python benchmarks/adaptive/step_parts.py "
                         + " ".join(recorded_path(a) if a.startswith("/") else a for a in (argv or sys.argv[1:])),
              "settings": {"concurrency": c, "requests": n, "repeats": args.repeats, "threads": 1,
                           "dtype": "float32", "max_new_tokens": args.max_new_tokens,
                           "drafter": recorded_path(args.drafter)},
              "results": result,
              "note": "CPU ms per decode step (process time), medians over the repeats. Nesting: decode_step "
                      "holds draft and verify_step; draft holds choose_drafted (which holds choice_plan), "
                      "catch_up, drafter_forward, verify_lengths (which holds calibrate and length_plan) and "
                      "proposals_lm_head; verify_step holds target_forward, accept, update_context and commit "
                      "(which holds observe). ms_per_step also holds prefill and admission."}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    for m, r in result.items():
        print(m, json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
