"""Torch ops dispatched per decode step, per mode and concurrency: a GPU step's launch count,
measured on the CPU.

The embedded pair is so small that on a GPU a step costs what its kernel launches cost (each op
a launch or more, some microseconds each), not what its arithmetic costs. The number of ops a
step dispatches is therefore the GPU figure that can be measured without one. Each mode runs
twice: with the target's attention chosen as on a CPU (per-request calls where padding wastes a
quarter of the padded call) and as on a GPU (one padded call), so the count shows what the
device rule saves.

    python benchmarks/gpu/dispatches.py --out benchmarks/gpu/dispatches.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch
from embedded import load, make_requests
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.engine_factory import make_engine
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.target import hf_target

# Step prices of the embedded pair on the H200 (bf16; benchmarks/gpu/h200_767cc69: a plain step
# 7-10 ms from c=1 to 64, a dflash step 3 ms above it at c=1), rounded. Fixed in place of the
# engine's measured CPU costs, they make adaflash and d2sd draft as they do on that GPU, where
# nearly every row drafts, at lengths that differ from row to row.
GPU_COSTS = StepCostModel(fixed=7e-3, per_token=5e-5, per_draft=1e-4, draft_fixed=2.5e-3)

# ops that only relabel a tensor (no kernel on any device)
VIEWS = {"aten.view", "aten.slice", "aten.select", "aten.unsqueeze", "aten.transpose", "aten.reshape",
         "aten.expand", "aten.t", "aten.detach", "aten.detach_", "aten.alias", "aten.as_strided",
         "aten.squeeze", "aten._unsafe_view", "aten.permute", "aten.unbind", "aten.split", "aten.lift_fresh"}


# ops whose output size depends on values: on a GPU each waits for the device (a nonzero inside)
DATA_DEPENDENT = {"aten.nonzero", "aten.masked_select", "aten.masked_scatter", "aten.unique", "aten._unique2",
                  "aten.repeat_interleave"}
INDEXING = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}


def _bool_index(args) -> bool:
    """Whether an index/index_put call indexes with a boolean mask (a nonzero on the device)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.mask_syncs = 0  # boolean-mask indexing and data-dependent shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in DATA_DEPENDENT or (name in INDEXING and _bool_index(args)):
            self.mask_syncs += 1
        return func(*args, **(kwargs or {}))


def count(engine, requests) -> dict:
    steps, step, reads = [0], engine._decode_step, [0]
    tolist = torch.Tensor.tolist

    def counted():
        steps[0] += 1
        step()

    def counted_tolist(t):
        reads[0] += 1
        return tolist(t)

    engine._decode_step = counted
    counter = OpCounter()
    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            engine.run(requests)
    finally:
        torch.Tensor.tolist = tolist
    n = max(steps[0], 1)
    total = sum(counter.ops.values())
    views = sum(v for k, v in counter.ops.items() if k in VIEWS)
    return {"steps": steps[0], "ops_per_step": total / n, "compute_ops_per_step": (total - views) / n,
            "attention_calls_per_step": counter.ops["aten.scaled_dot_product_attention"] / n,
            # .tolist() and .item()/int()/float()/bool() of a tensor: on a GPU each read of a device
            # tensor is a synchronisation (here every tensor is on the host, so all are counted)
            "host_reads_per_step": (reads[0] + counter.ops["aten._local_scalar_dense"]) / n,
            # boolean-mask indexing and ops with value-dependent output sizes: on a GPU each one
            # waits for the device too, and these run on activations, so none is a host tensor's
            "mask_syncs_per_step": counter.mask_syncs / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="ar,dflash,adaflash,d2sd")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--tree-rule", default="load_aware", choices=("load_aware", "fixed"),
                    help="d2sd's rule; fixed builds the whole tree every step, as the load-aware rule "
                         "nearly does where verify tokens are cheap (a GPU)")
    ap.add_argument("--tree-k", type=int, default=2)
    ap.add_argument("--branch-width", type=int, default=1)
    ap.add_argument("--gpu-costs", action="store_true",
                    help="plan with the GPU_COSTS step prices instead of the CPU's measured ones")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pair, prompts = load("cpu", "float32", args.requests,
                         d2sd={"tree_rule": args.tree_rule, "tree_k": args.tree_k, "branch_width": args.branch_width})
    max_seq = max(len(p) for p in prompts) + args.max_new_tokens

    def requests():
        return make_requests(pair, prompts, args.max_new_tokens)

    real_rule, rows = hf_target._prefer_ragged_attention, []
    try:
        for c in (int(x) for x in args.concurrency.split(",")):
            for mode in args.modes.split(","):
                row = {"mode": mode, "concurrency": c}
                for rule in ("cpu", "cuda"):
                    hf_target._prefer_ragged_attention = lambda q, s, _t, rule=rule: real_rule(q, s, rule)
                    engine = make_engine(pair, mode, c, max_seq, 0, num_requests=len(prompts))
                    if args.gpu_costs:
                        engine.cost_model = GPU_COSTS
                    engine.run(requests()[:2])  # the cost profile and first allocations, uncounted
                    row[rule] = count(engine, requests())
                rows.append(row)
                a, b = row["cpu"], row["cuda"]
                print(f"c={c:3d} {mode:9s} ops/step {a['ops_per_step']:7.0f} -> {b['ops_per_step']:7.0f} "
                      f"(kernel ops {a['compute_ops_per_step']:6.0f} -> {b['compute_ops_per_step']:6.0f}, "
                      f"attention calls {a['attention_calls_per_step']:5.1f} -> {b['attention_calls_per_step']:5.1f}, "
                      f"host reads {a['host_reads_per_step']:5.1f} -> {b['host_reads_per_step']:5.1f}, "
                      f"mask syncs {a['mask_syncs_per_step']:5.1f} -> {b['mask_syncs_per_step']:5.1f})",
                      flush=True)
    finally:
        hf_target._prefer_ragged_attention = real_rule
    from sglang_adaflash.bench.runner import recorded_path

    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:  # a machine's absolute path says nothing on another machine
        given[given.index("--out") + 1] = recorded_path(args.out)
    doc = {"command": "benchmarks/gpu/dispatches.py " + " ".join(given),
           "torch": torch.__version__, "config": {k: v for k, v in vars(args).items() if k != "out"},
           "note": "per decode step; 'cpu' and 'cuda' name the attention rule, both counted on the CPU",
           "results": rows}
    write_text_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
