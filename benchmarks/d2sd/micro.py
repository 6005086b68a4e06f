"""Micro-benchmarks of mode d2sd's parts on the embedded pair (CPU, one thread, float32).

    .venv/bin/python benchmarks/d2sd/micro.py --out benchmarks/d2sd/micro.json

1. The recovery drafter's forward and LM head for m branch blocks: the whole block against only
   the slots a 4-token branch reads (`DFlashDrafter.forward(read=...)`).
2. The tree verify forward (24 nodes a request over a 250-token context): one masked attention
   call against the torch cascade (context and nodes apart, merged).
3. Where a c=1 decode step's time goes (load-aware rule, tree-k 4, branch-len 4, width 4), by
   cProfile over 16 in-domain requests, beside a dflash step and a step of the tree from the
   first drafter alone (`--branch-drafter first`); and how many plan evaluations a step makes
   with the warm-started price against a price started at 0 every step.

Each timing is the best of several repeats, both sides of a comparison measured back to back.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR
from sglang_adaflash.bench.runner import BenchConfig, build_workload
from sglang_adaflash.d2sd.cascade import TorchCascade
from sglang_adaflash.d2sd.cli import RECOVERY_DIR, D2SDOptions, attach_recovery
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.recovery_drafter import TreeProposer
from sglang_adaflash.d2sd.tree import Branch, build_row, flatten
from sglang_adaflash.d2sd.tree_target import tree_forward
from sglang_adaflash.engine.engine import EngineStats
from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.engine_factory import make_engine
from sglang_adaflash.launch.loading import load_pair
from sglang_adaflash.launch.prompts import read_prompts

PROMPTS = Path(__file__).with_name("prompts16.jsonl")


def best_ms(loops: int, fn, *args, repeats: int = 3) -> float:
    """Best of `repeats` means of fn(*args) over `loops` calls, in ms."""
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn(*args)
        out = min(out, (time.perf_counter() - t0) / loops * 1e3)
    return round(out, 2)


def branch_logits(pair, proposer, ids, ctx, slots, read):
    return pair.recovery.logits(proposer.propose_branches(ids, ctx, slots, read))


@torch.inference_mode()
def recovery_forward(pair) -> list[dict]:
    proposer = TreeProposer(pair.drafter, pair.recovery, num_slots=8, capacity=400)
    b = pair.drafter.config.block_size
    rows = []
    for m in (2, 8):
        ids = torch.full((m, b), pair.drafter.config.mask_token_id)
        ctx, slots = torch.full((m,), 200), torch.arange(m) % 8
        read = (torch.arange(1, 5)[None] + torch.arange(m)[:, None] % 3).clamp(max=b - 1)
        whole = best_ms(30, branch_logits, pair, proposer, ids, ctx, slots, None)
        part = best_ms(30, branch_logits, pair, proposer, ids, ctx, slots, read)
        rows.append({"branches": m, "whole_block_ms": whole, "read_slots_ms": part})
    return rows


@torch.inference_mode()
def tree_attention(pair) -> list[dict]:
    target = pair.target
    target.capture_layer_ids = list(pair.drafter.config.target_layer_ids)
    rows = []
    for bs in (1, 8, 32):
        cache = target.new_cache(bs, 400)
        starts = torch.full((bs,), 250) - torch.arange(bs)
        trees = [build_row(5, list(range(10, 25)), [Branch(1, [30, 31, 32, 33]), Branch(2, [40, 41, 42, 43])])
                 for _ in range(bs)]
        flat = flatten(trees, "cpu")
        masked = best_ms(5, tree_forward, target, cache, flat, starts, None)
        cascade = best_ms(5, tree_forward, target, cache, flat, starts, TorchCascade())
        rows.append({"requests": bs, "nodes_per_request": trees[0].size, "masked_ms": masked, "torch_cascade_ms": cascade})
    return rows


class _ColdPrice(D2SDEngine):
    """The plan's price started at 0 every step (before the warm start)."""

    def _draft_trees(self, *a, **kw):
        self._last_value = 0.0
        return super()._draft_trees(*a, **kw)


def _profile(engine, requests) -> tuple[pstats.Stats, int]:
    engine.stats = EngineStats()
    pr = cProfile.Profile()
    pr.enable()
    engine.run(requests)
    pr.disable()
    return pstats.Stats(pr), engine.stats.steps


def _cum_ms(stats: pstats.Stats, steps: int, name: str) -> float:
    """Cumulative ms per step of the outermost function of that name (an override's time
    includes the method it extends, so the largest entry is taken, not their sum)."""
    total = max((v[3] for k, v in stats.stats.items() if k[2] == name), default=0.0)
    return round(total / steps * 1e3, 2)


def _calls(stats: pstats.Stats, name: str) -> int:
    return sum(v[1] for k, v in stats.stats.items() if k[2] == name)


def step_breakdown(pair) -> dict:
    specs = read_prompts([str(PROMPTS)])
    cfg = BenchConfig(target=str(TARGET_DIR), drafter=str(DRAFTER_DIR), prompts=[], max_new_tokens=64)
    wl = build_workload(specs, pair, cfg, 16)

    def reqs():
        return wl.requests(16, pair.stop_token_ids)

    kw = dict(tree_k=4, branch_len=4, branch_width=4, tree_rule="load_aware", max_batch_size=1, max_seq_len=600)
    d2sd, cold = D2SDEngine(pair.target, pair.drafter, pair.recovery, **kw), _ColdPrice(
        pair.target, pair.drafter, pair.recovery, **kw)
    dflash = make_engine(pair, "dflash", 1, 600, 0, num_requests=16)
    for e in (d2sd, cold, dflash):
        e.run(reqs()[:4])
    st, steps = _profile(d2sd, reqs())
    parts = {name: _cum_ms(st, steps, name) for name in
             ("_decode_step", "tree_forward", "_walk", "_chain_logits", "_branches", "plan_tree", "extend_context")}
    cold_st, cold_steps = _profile(cold, reqs())
    df_st, df_steps = _profile(dflash, reqs())
    first = D2SDEngine(pair.target, pair.drafter, None, branch_drafter="first",
                       **{**kw, "branch_len": 1})
    first.run(reqs()[:4])
    fs_st, fs_steps = _profile(first, reqs())
    return {
        "d2sd_ms_per_step": parts,
        "d2sd_steps": steps,
        "dflash_ms_per_step": {name: _cum_ms(df_st, df_steps, name) for name in
                               ("_decode_step", "forward", "_draft", "_update_context")},
        "first_drafter_tree_ms_per_step": {name: _cum_ms(fs_st, fs_steps, name) for name in
                                           ("_decode_step", "tree_forward", "_walk", "_chain_logits",
                                            "_first_drafter_branches", "plan_tree", "extend_context")},
        "plan_evaluations_per_step": {
            "warm_start": round(_calls(st, "plan_at") / steps, 2),
            "price_from_zero": round(_calls(cold_st, "plan_at") / cold_steps, 2),
            "first_drafter_tree": round(_calls(fs_st, "plan_at") / fs_steps, 2),
        },
        "note": "cProfile adds its own overhead; the parts are cumulative times (tree_forward: the "
                "target's tree verify up to its final states, _walk: its LM head where the walk reads and "
                "the walk; _chain_logits: the first drafter; _branches: the recovery drafter and branch "
                "assembly; extend_context: both drafters' contexts; dflash's forward: every target forward "
                "of the run, prefill included, per decode step; first_drafter_tree: --branch-drafter first, "
                "the same tree-k and width)",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    attach_recovery(pair, D2SDOptions(recovery_drafter=str(RECOVERY_DIR)))
    for d in (pair.drafter, pair.recovery):
        d.share_target_modules(pair.target.embed_tokens, pair.target.lm_head)
    doc = {
        "command": "python benchmarks/d2sd/micro.py --out " + args.out,
        "settings": {"dtype": "float32", "threads": 1, "device": "cpu"},
        "recovery_forward": recovery_forward(pair),
        "tree_attention": tree_attention(pair),
        "step_c1": step_breakdown(pair),
    }
    write_text_atomic(Path(args.out), json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
