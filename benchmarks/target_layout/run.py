"""The target's forward with its projection weights row-major (as loaded) and column-major
(sglang_adaflash.target.weight_layout), on the embedded pair, side by side in one run.

One target, its per-layer projections relaid out back and forth between timed calls (outside
the timing), the two layouts alternating call by call (row, column, column, row) so a noisy
neighbour hits both alike. Shapes are a decode step's: `--batch` requests over `--context`
cached tokens, each verifying L tokens (L = 1 is a plain step). Per shape it records the median
seconds of each layout, their ratio, and whether the two layouts' logits were equal.

The embedded target's LM head is tied to its embedding; HFTarget gives it its own column-major
copy (weight_layout.column_major_tied_head), so "row-major" here is a row-major copy of the
table (what the tied head multiplied by) and "column-major" the copy HFTarget makes. The head's
GEMM alone, at the rows a verify or the drafter's proposals give it, is timed apart the same
way (`lm_head_gemm`).

    python benchmarks/target_layout/run.py --out benchmarks/target_layout/results.json
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
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.alternating import alternating_medians  # noqa: E402
from sglang_adaflash.bench.machine import cpu_description  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.target.hf_target import TargetBatch  # noqa: E402
from sglang_adaflash.target.weight_layout import column_major_linears  # noqa: E402


def relaid(target) -> list[torch.nn.Parameter]:
    """The weights HFTarget relaid out column-major (row-major again by set_layout(..., False))."""
    return [m.weight for m in target.model.modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.is_contiguous()]


def set_layout(target, weights: list[torch.nn.Parameter], column_major: bool) -> None:
    """Column-major as HFTarget lays them out (weight_layout), or `weights` row-major again."""
    if column_major:
        column_major_linears(target.model)
        return
    with torch.no_grad():
        for w in weights:
            w.data = w.data.contiguous()


def measure(target, weights, bs: int, lengths: list[int], context: int, repeats: int) -> list[dict]:
    cache = target.new_cache(bs, context + max(lengths) + 1)
    times: dict[tuple[int, bool], list[float]] = {}
    equal: dict[int, bool] = {}
    diff: dict[int, float] = {}
    with torch.inference_mode():
        target.forward(TargetBatch.from_lists([[5] * context] * bs, [0] * bs), cache,
                       logits_rows=torch.arange(bs) * context + context - 1)
        for rep in range(repeats + 1):  # the first round is untimed (first kernels at these shapes)
            for n in lengths:
                batch = TargetBatch.from_lists([[7 + j for j in range(n)] for _ in range(bs)], [context] * bs)
                logits = {}
                for column in (False, True, True, False):
                    set_layout(target, weights, column)
                    t0 = time.perf_counter()
                    out, _ = target.forward(batch, cache)
                    if rep:
                        times.setdefault((n, column), []).append(time.perf_counter() - t0)
                    logits[column] = out
                same = bool(torch.equal(logits[False], logits[True]))
                equal[n] = equal.get(n, True) and same
                diff[n] = max(diff.get(n, 0.0), float((logits[False] - logits[True]).abs().max()))
    set_layout(target, weights, True)
    rows = []
    for n in lengths:
        row_major, column_major = (statistics.median(times[(n, c)]) for c in (False, True))
        rows.append({"batch": bs, "verify_len": n, "row_major_ms": round(1e3 * row_major, 3),
                     "column_major_ms": round(1e3 * column_major, 3),
                     "column_over_row": round(column_major / row_major, 3),
                     "logits_equal": equal[n], "max_abs_diff": diff[n]})
    return rows


def head_gemm(target, rows: list[int], repeats: int) -> list[dict]:
    """The LM head's GEMM alone (x [n, H] @ W.T) with W row-major and column-major, alternating."""
    w = target.lm_head.weight.detach()
    layouts = {False: w.contiguous(), True: w.t().contiguous().t()}
    g = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, w.shape[1], generator=g, dtype=w.dtype)
            row_us, col_us = (1e6 * t for t in alternating_medians(
                lambda x=x: torch.nn.functional.linear(x, layouts[False]),
                lambda x=x: torch.nn.functional.linear(x, layouts[True]), repeats))
            out.append({"rows": n, "row_major_us": round(row_us, 1), "column_major_us": round(col_us, 1),
                        "column_over_row": round(col_us / row_us, 3)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 7, 16])
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32", need_drafter=False)
    weights = relaid(pair.target)
    rows = [r for bs in args.batch for r in measure(pair.target, weights, bs, args.lengths, args.context, args.repeats)]
    head = head_gemm(pair.target, [1, 2, 4, 8, 16], 10 * args.repeats)
    for r in rows:
        print(f"bs {r['batch']:2d} L {r['verify_len']:2d}: row-major {r['row_major_ms']:7.3f} ms, column-major "
              f"{r['column_major_ms']:7.3f} ms, ratio {r['column_over_row']:.3f}, logits equal {r['logits_equal']}")
    for r in head:
        print(f"LM head GEMM, {r['rows']:2d} rows: row-major {r['row_major_us']:6.1f} us, column-major "
              f"{r['column_major_us']:6.1f} us, ratio {r['column_over_row']:.3f}")
    out = {"command": "benchmarks/target_layout/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": cpu_description(), "threads": args.threads, "context": args.context,
           "repeats": args.repeats, "relaid_weights": len(weights), "rows": rows, "lm_head_gemm": head}
    if args.out:
        write_text_atomic(Path(args.out), json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
