"""Mode d2sd with the verify's logits computed where the greedy walk can read them, against every
node's logits (the engine before), on the embedded pair: same trees, same tokens, CPU tok/s.

    .venv/bin/python benchmarks/d2sd/lazy_logits.py --out benchmarks/d2sd/lazy_logits.json

Fixed default tree (tree-k 2, branch-len 4), 16 in-domain prompts, 64 new tokens, float32, one
thread; the two engines alternate over `--repeats` runs and the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR
from sglang_adaflash.bench.runner import BenchConfig, build_workload
from sglang_adaflash.d2sd.cli import RECOVERY_DIR, D2SDOptions, attach_recovery
from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.tree_verify import greedy_walk
from sglang_adaflash.engine.engine import EngineStats
from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.loading import load_pair
from sglang_adaflash.launch.prompts import read_prompts

PROMPTS = Path(__file__).with_name("prompts16.jsonl")


class ReadNodes(D2SDEngine):
    """The lazy walk at every size (the engine takes one call over every node for trees of at
    most ONE_READ_ROWS rows since commit 89a6b49)."""

    ONE_READ_ROWS = 0


class EveryNode(D2SDEngine):
    """The walk over every node's logits (greedy rows only: the workload is greedy)."""

    def _walk(self, seqs, trees, fwd):
        ids = fwd.logits.argmax(-1).tolist()
        return [greedy_walk(t, ids[i][: t.size]) for i, t in enumerate(trees)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    attach_recovery(pair, D2SDOptions(recovery_drafter=str(RECOVERY_DIR)))
    specs = read_prompts([str(PROMPTS)])
    cfg = BenchConfig(target=str(TARGET_DIR), drafter=str(DRAFTER_DIR), prompts=[], max_new_tokens=64)
    wl = build_workload(specs, pair, cfg, 16)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        kw = dict(tree_k=2, branch_len=4, tree_rule="fixed", max_batch_size=c, max_seq_len=600)
        engines = {"read_nodes": ReadNodes(pair.target, pair.drafter, pair.recovery, **kw),
                   "every_node": EveryNode(pair.target, pair.drafter, pair.recovery, **kw)}
        tput = {n: [] for n in engines}
        outs = {}
        for e in engines.values():
            e.run(wl.requests(4, pair.stop_token_ids))
        for rep in range(args.repeats):
            for n in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                e = engines[n]
                e.stats = EngineStats()
                c0 = time.process_time()
                got = e.run(wl.requests(max(16, 2 * c), pair.stop_token_ids))
                tput[n].append(sum(len(o.output_ids) for o in got) / (time.process_time() - c0))
                outs[n] = [o.output_ids for o in got]
        med = {n: statistics.median(v) for n, v in tput.items()}
        rows.append({"concurrency": c, "cpu_tok_s": {n: round(v, 1) for n, v in med.items()},
                     "samples": {n: [round(x, 1) for x in v] for n, v in tput.items()},
                     "ratio_read_nodes_vs_every_node": round(med["read_nodes"] / med["every_node"], 3),
                     "same_tokens": outs["read_nodes"] == outs["every_node"]})
        print(rows[-1], flush=True)
    doc = {"command": "python benchmarks/d2sd/lazy_logits.py --out " + args.out,
           "settings": {"tree": "fixed, tree-k 2, branch-len 4", "dtype": "float32", "threads": 1,
                        "repeats": args.repeats},
           "rows": rows}
    write_text_atomic(Path(args.out), json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
