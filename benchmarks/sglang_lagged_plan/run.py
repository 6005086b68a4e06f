"""What the SGLang plugin's lagged verify total costs in length accuracy, against the plan a
host sync would allow.

In compact mode the host must know a step's total verify tokens before it launches the verify
(the CUDA-graph bucket, the packed batch). The plugin fixes it from the previous steps' mean
rule length (``length_budget.LaggedMean``, read without waiting for the device) and lets the
device split exactly that total among the requests by this step's length head
(``fit_to_total``). The alternative reads this step's rule lengths back to the host (a sync
between drafting and verify) and verifies exactly them.

This script records a real decode trace of the embedded pair (the reference engine in dflash
mode, so every block is verified whole and each request's true acceptance ``a`` is known,
plus the length head's ratio for every drafted request) and replays it through the plugin's
own planning functions three ways, per step:

- ``sync``: the rule's lengths (what a host read of this step's plan verifies);
- ``lag1``: the plugin's plan with the previous step's mean (the synchronous scheduler, and
  the overlap scheduler whenever the copy has landed);
- ``lag2``: the same two steps behind (the overlap scheduler when it has not);
- ``whole``: whole blocks (DFLASH);
- ``sync_buckets``, ``lag1_buckets``: ``sync`` and ``lag1`` with the total rounded up to the
  CUDA-graph token bucket (``bs * B`` for SGLang's captured batch sizes), whose spare tokens
  the plugin verifies too, as it does when graphs replay.

A request verifying ``L`` slots commits ``min(a, L - 1) + 1`` tokens (greedy: acceptance is
capped at the verified slots), so each plan's verified and committed tokens are exact, not
modelled. Step time uses the plugin's default cost model (``ADAFLASH_COST_FIXED_MS`` 8,
``ADAFLASH_COST_PER_TOKEN_US`` 16), the same one its load-aware rule prices lengths with.

    python benchmarks/sglang_lagged_plan/run.py --out benchmarks/sglang_lagged_plan/results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_adaflash.assets import MODELS_DIR, WORKLOADS_DIR
from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.request import Request
from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.engine_factory import make_engine
from sglang_adaflash.launch.loading import load_pair
from sglang_adaflash.launch.prompts import read_prompts, resolve_prompt_ids
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.planner.lengths import survival_rate
from sglang_adaflash.sglang_plugin import length_budget as lb

#: SGLang's CUDA-graph batch sizes up to 64; compact graphs are keyed by bs * B tokens
CAPTURE_BS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)


def record_trace(engine, requests) -> list[dict]:
    """One dflash-mode run; per step the drafted rows' head ratio, cap and true acceptance."""
    trace: list[dict] = []
    verify_lengths, commit = engine._verify_lengths, engine._commit

    def lengths(spec, hidden, cap):
        verify_lengths(spec, hidden, cap)  # dflash: whole blocks (cap)
        rows = torch.tensor(spec.drafted, dtype=torch.long)
        with torch.no_grad():
            ratio = engine.drafter.length_head(hidden).float().cpu()
        trace.append({"rows": spec.drafted, "ratio": ratio, "cap": cap[rows].clone()})

    def commit_step(seqs, spec, committed, result):
        trace[-1]["accepted"] = result.num_accepted.cpu()[trace[-1]["rows"]]
        return commit(seqs, spec, committed, result)

    engine._verify_lengths, engine._commit = lengths, commit_step
    engine.run(requests)
    return [t for t in trace if "accepted" in t]


def replay(trace, *, block: int, rule: str, min_len: int, rate: float, cost: StepCostModel,
           lag: int | None, grid: list[int] | None) -> dict:
    """Replay the trace with one plan; lag None = sync (the rule's own lengths)."""
    history = [float(block)]  # LaggedMean starts at whole blocks
    verified = committed = 0
    seconds = 0.0
    total_err = []
    for step in trace:
        ratio, cap, acc = step["ratio"], step["cap"], step["accepted"]
        bs = len(ratio)
        rule_lens = lb.plan_verify_lengths(
            ratio, block, rate=rate, min_len=min_len, cost=cost, rule=rule, max_len=cap
        )
        if lag == 0:  # whole blocks
            lens = cap.clamp(max=block)
        elif lag is None and grid is None:
            lens = rule_lens
        else:  # a host total: this step's (sync) or a lagged one, fitted on the device
            if lag is None:
                mean = float(rule_lens.float().mean())
            else:
                mean = history[-lag] if len(history) >= lag else history[0]
            grid_bs = grid if grid and bs <= CAPTURE_BS[-1] else None
            budget = lb.plan_host_budget(
                block_size=block, min_len=min_len, remaining=cap.tolist(), bs=bs,
                mean_len=mean, grid=grid_bs,
            )  # fmt: skip
            lo, hi = torch.tensor(budget.lo), torch.tensor(budget.cap)
            lens = lb.fit_to_total(survival_rate(ratio, block), lo, hi, budget.total, block)
            if lag is not None:
                total_err.append(abs(int(lens.sum()) - int(rule_lens.sum())) / int(rule_lens.sum()))
        history.append(float(rule_lens.float().mean()))
        v = int(lens.sum())
        c = int((torch.minimum(acc, lens - 1) + 1).sum())
        verified += v
        committed += c
        seconds += cost.fixed + cost.per_token * v
    return {
        "verified": verified,
        "committed": committed,
        "committed_per_verified": committed / verified,
        "modelled_tok_s": committed / seconds,
        "total_rel_error": statistics.fmean(total_err) if total_err else 0.0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--per-domain", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pair = load_pair(MODELS_DIR / "target", MODELS_DIR / "drafter", dtype="float32")
    cfg = pair.drafter.config
    block = cfg.block_size
    stop = tuple(pair.stop_token_ids)
    specs = [s for name in ("code", "prose", "math")
             for s in read_prompts(WORKLOADS_DIR / f"{name}.heldout.jsonl")[: args.per_domain]]
    prompts = [(resolve_prompt_ids(s, pair.tokenizer), s.domain) for s in specs]
    prompts = [prompts[i] for k in range(args.per_domain)
               for i in (k, k + args.per_domain, k + 2 * args.per_domain)]  # mixed, in thirds
    max_seq = max(len(p) for p, _ in prompts) + args.max_new_tokens
    cost = StepCostModel(fixed=8e-3, per_token=16e-6)
    grid = [bs * block for bs in CAPTURE_BS]
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        n = max(2 * c, len(prompts))
        reqs = [Request(list(prompts[i % len(prompts)][0]),
                        SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=stop),
                        f"r{i}", prompts[i % len(prompts)][1]) for i in range(n)]  # fmt: skip
        engine = make_engine(pair, "dflash", c, max_seq, 0, num_requests=n)
        t0 = time.perf_counter()
        trace = record_trace(engine, reqs)
        for rule in ("load_aware", "paper"):
            plans = {
                "whole": replay(trace, block=block, rule=rule, min_len=cfg.length_head_min_len,
                                rate=cfg.length_head_rate, cost=cost, lag=0, grid=None),
            }  # fmt: skip
            for name, lag, g in (("sync", None, None), ("lag1", 1, None), ("lag2", 2, None),
                                 ("sync_buckets", None, grid), ("lag1_buckets", 1, grid)):
                plans[name] = replay(trace, block=block, rule=rule,
                                     min_len=cfg.length_head_min_len, rate=cfg.length_head_rate,
                                     cost=cost, lag=lag, grid=g)  # fmt: skip
            rows.append({"concurrency": c, "rule": rule, "steps": len(trace),
                         "mean_bs": statistics.fmean(len(t["ratio"]) for t in trace),
                         "plans": plans})  # fmt: skip
            s, l1 = plans["sync"], plans["lag1"]
            print(f"c={c:>3} {rule:>10}: steps {len(trace)}, total error lag1 "
                  f"{l1['total_rel_error']:.3f}, committed/verified sync "
                  f"{s['committed_per_verified']:.3f} lag1 {l1['committed_per_verified']:.3f}, "
                  f"modelled tok/s lag1/sync {l1['modelled_tok_s'] / s['modelled_tok_s']:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
    out = {"machine": platform.machine(), "python": sys.version.split()[0],
           "torch": torch.__version__, "args": vars(args), "rows": rows}  # fmt: skip
    write_text_atomic(Path(args.out), json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
