"""What `--branch-drafter joint` costs and what it adds, in parts (embedded pair, CPU, one thread).

1. The drafting pass: the first drafter's own (`DFlashProposer.propose`) against the stacked
   pass of both drafters (`TreeProposer.propose_joint`), at a 250-token context, medians of
   300 calls, the two interleaved in 5 rounds.
2. Why a second drafter's weights cost on this CPU: one [10, 256] x [256, 768] matmul repeated
   on the same weight matrix (it stays in the core's cache) against 40 different ones of that
   size (about a target forward's worth of weights), microseconds per call.
3. What the recovery drafter adds, at T=0 with the fixed rule (tree-k 4, width 4; deterministic):
   tau of the first drafter's tree, of the joint tree, and of the joint tree with the recovery
   drafter's alternatives also at slots 2-4 of the same pass (an ablation, not an engine option),
   on the 16 in-domain prompts of prompts16.jsonl.

    python benchmarks/d2sd/joint_micro.py --out benchmarks/d2sd/joint_micro.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.runner import BenchConfig, build_workload  # noqa: E402
from sglang_adaflash.d2sd.cli import RECOVERY_DIR  # noqa: E402
from sglang_adaflash.d2sd.engine import D2SDEngine  # noqa: E402
from sglang_adaflash.d2sd.recovery_drafter import TreeProposer, load_recovery_drafter  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.launch.prompts import read_prompts  # noqa: E402

PROMPTS = ROOT / "benchmarks" / "d2sd" / "prompts16.jsonl"


def _median_ms(fn, n: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class DeepJoint(D2SDEngine):
    """Ablation: the recovery drafter's alternatives at every slot its joint pass read (1..L),
    not only at slot 1 (its block there has masks where the chain's tokens would be)."""

    def _joint_branches(self, seqs, rows, chain_l, pending, hot_set, q):
        span = self._joint_logits_now.shape[1]
        near = [p for p in pending if p[1] <= span]
        out = self._first_drafter_branches(seqs, rows, chain_l, [p for p in pending if p[1] > span], hot_set, q)
        for p in near:
            logits = self._joint_logits_now[[p[0]], p[1] - 1 :]
            for j, mine in self._branches_from(seqs, rows, chain_l, [p], hot_set, logits).items():
                out[j] = mine + out.get(j, [])
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    recovery = load_recovery_drafter(RECOVERY_DIR, pair.drafter)
    for d in (pair.drafter, recovery):
        d.share_target_modules(pair.target.embed_tokens, pair.target.lm_head)
    report: dict = {"command": "python benchmarks/d2sd/joint_micro.py --out " + str(args.out),
                    "settings": {"dtype": "float32", "threads": 1}}

    # 1. the drafting pass
    ctx = 250
    prop = TreeProposer(pair.drafter, recovery, num_slots=1, capacity=ctx + 32, joint=True)
    width = pair.drafter.config.num_context_layers * pair.drafter.config.hidden_size
    prop.extend_context(torch.randn(1, ctx, width, generator=torch.Generator().manual_seed(0)), torch.tensor([0]), [0])
    last, lens = torch.tensor([5]), torch.tensor([ctx])
    first_ms, joint_ms = [], []
    with torch.inference_mode():
        for _ in range(5):
            first_ms.append(_median_ms(lambda: prop.propose(last, lens, None, slots=[0]), 300))
            joint_ms.append(_median_ms(lambda: prop.propose_joint(last, lens, [0]), 300))
    report["drafting_pass_ms"] = {"context": ctx, "first_drafter": round(statistics.median(first_ms), 3),
                                  "both_stacked": round(statistics.median(joint_ms), 3)}

    # 2. weights from the cache or not
    x = torch.randn(10, 256)
    weights = [torch.randn(768, 256) for _ in range(40)]
    with torch.inference_mode():
        same = _median_ms(lambda: [torch.nn.functional.linear(x, weights[0]) for _ in range(40)], 200) / 40
        many = _median_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], 200) / 40
    report["matmul_us"] = {"shape": "[10, 256] x [256, 768]", "same_weight": round(same * 1e3, 1),
                           "40_different_weights": round(many * 1e3, 1)}

    # 3. what the recovery drafter adds (T=0, fixed rule: deterministic)
    cfg = BenchConfig(target=str(TARGET_DIR), drafter=str(DRAFTER_DIR), prompts=[], max_new_tokens=64)
    wl = build_workload(read_prompts([str(PROMPTS)]), pair, cfg, 16)
    trees = {
        "first drafter's ranks (tree-k 4, width 4)": (D2SDEngine, None, "first", 1),
        "joint (tree-k 4, width 4, branch-len 4)": (D2SDEngine, recovery, "joint", 4),
        "joint, recovery alternatives at slots 1-4 (ablation)": (DeepJoint, recovery, "joint", 4),
    }
    report["fixed_tree_tau"] = {}
    for name, (cls, rec, src, ln) in trees.items():
        eng = cls(pair.target, pair.drafter, rec, branch_drafter=src, tree_k=4, branch_width=4, branch_len=ln,
                  tree_rule="fixed", max_batch_size=1, max_seq_len=600)
        eng.run(wl.requests(16, pair.stop_token_ids))
        s = eng.stats
        report["fixed_tree_tau"][name] = {"tau": round(s.committed_tokens / s.steps, 3),
                                          "verified_per_step": round(s.verified_tokens / s.steps, 2)}
    write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
