"""Every engine configuration once, on a few short requests, on one device: which ones run there.

A device lease is minutes long, so `run.sh` calls this first and benchmarks only the modes that
ran. One process loads the embedded pair once and tries each case apart: a failure is recorded
with its traceback and the next case goes on. At T=0 each case's output is compared with `ar`'s
token for token; in a low-precision dtype a verify of many tokens and a one-token decode round
differently, so the comparison is reported, not required (`run.sh` checks it in float32).

    python benchmarks/gpu/smoke.py --device cuda --dtype bfloat16 --out smoke.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
from embedded import attach, load, make_requests

from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.engine_factory import make_engine

# (name, mode, d2sd options, temperature)
CASES = [
    ("ar", "ar", None, 0.0),
    ("dflash", "dflash", None, 0.0),
    ("adaflash", "adaflash", None, 0.0),
    ("d2sd", "d2sd", {}, 0.0),
    ("d2sd_fixed", "d2sd", {"tree_rule": "fixed"}, 0.0),
    ("d2sd_auto_k4_w4", "d2sd", {"branch_drafter": "auto", "tree_k": 4, "branch_width": 4}, 0.0),
    ("d2sd_torch_cascade", "d2sd", {"tree_rule": "fixed", "tree_attention": "torch"}, 0.0),
    ("d2sd_draft_off", "d2sd", {"draft_off": True}, 0.0),
    ("dflash_t0.7", "dflash", None, 0.7),
    ("adaflash_t0.7", "adaflash", None, 0.7),
    ("d2sd_t0.7", "d2sd", {"tree_rule": "fixed"}, 0.7),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    pair, prompts = load(args.device, args.dtype, args.requests, domains=("code",))
    max_seq = max(len(p) for p in prompts) + args.max_new_tokens
    cases, reference = [], None
    for name, mode, d2sd, temperature in CASES:
        case = {"case": name, "mode": mode, "d2sd": d2sd, "temperature": temperature}
        t0 = time.perf_counter()
        try:
            if d2sd is not None:
                attach(pair, d2sd)
            engine = make_engine(pair, mode, args.concurrency, max_seq, 0, num_requests=len(prompts))
            outs = engine.run(make_requests(pair, prompts, args.max_new_tokens, temperature))
            failed = [o.error for o in outs if not o.ok]
            ids = [o.output_ids for o in outs]
            case.update(ok=not failed, request_errors=failed[:3], tokens=sum(len(x) for x in ids),
                        tau=sum(o.stats.committed_tokens for o in outs) / max(1, sum(o.stats.steps for o in outs)))
            if mode == "ar":
                reference = ids
            elif temperature == 0 and reference is not None:
                case["equal_to_ar"] = sum(a == b for a, b in zip(reference, ids))
                case["of"] = len(ids)
        except Exception as e:  # a case that cannot run here is the finding: record it, go on
            case.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        case["seconds"] = round(time.perf_counter() - t0, 2)
        cases.append(case)
        eq = f" equal {case['equal_to_ar']}/{case['of']}" if "equal_to_ar" in case else ""
        print(f"{name:22s} {'ok' if case['ok'] else 'FAILED'} {case['seconds']:6.2f} s{eq}"
              + ("" if case["ok"] else f"  {case.get('error') or case.get('request_errors')}"), flush=True)
    doc = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__,
           "cuda": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None, "cases": cases}
    write_text_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    ok_modes = sorted(m for m in {c["mode"] for c in cases} if all(c["ok"] for c in cases if c["mode"] == m))
    print("modes that ran in every case:", ",".join(ok_modes))
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
