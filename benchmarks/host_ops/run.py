"""Two small ops of a decode step, timed both ways on the shapes the engine gives them, side by
side in one run: the greedy token ids (`argmax` against `max(-1).indices`, core.sampling.greedy_ids)
and the drafter's RoPE (computed, DFlashDrafter.rope, against read from the proposer's table,
DFlashProposer.rope_at). The two ways alternate call by call (a, b, b, a); medians over the
rounds. Each pair is also checked to give the same values.

    python benchmarks/host_ops/run.py --out benchmarks/host_ops/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from sglang_adaflash.bench.alternating import alternating_medians  # noqa: E402
from sglang_adaflash.bench.machine import cpu_description  # noqa: E402
from sglang_adaflash.core.sampling import greedy_ids  # noqa: E402
from sglang_adaflash.engine.proposer import DFlashProposer  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402


def alternate(a, b, repeats: int) -> tuple[float, float]:
    """Median microseconds of a() and b(), called a, b, b, a per round (the first round untimed)."""
    return tuple(1e6 * t for t in alternating_medians(a, b, repeats))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(TARGET_DIR, DRAFTER_DIR, dtype="float32")
    vocab = pair.target.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        # a plain step's logits (1 row), a 5-token verify's [1, 5, V], 4 proposals' [4, V], c=8's [8, 1, V]
        for shape in ((1, vocab), (1, 5, vocab), (4, vocab), (8, 1, vocab)):
            x = torch.randn(*shape, generator=g)
            same = bool(torch.equal(x.argmax(-1), greedy_ids(x)))
            arg_us, max_us = alternate(lambda x=x: x.argmax(-1), lambda x=x: x.max(-1).indices, args.repeats)
            rows.append({"op": "greedy ids", "shape": list(shape), "argmax_us": round(arg_us, 1),
                         "max_indices_us": round(max_us, 1), "same": same})
        drafter = pair.drafter
        prop = DFlashProposer(drafter, num_slots=1, capacity=512)
        for width in (16, 3):  # a block's positions, a drafted row's committed tokens
            positions = torch.arange(150, 150 + width)[None]
            computed = drafter.rope(positions, drafter.fc.weight.dtype)
            table = prop.rope_at(positions)
            same = all(torch.equal(a, b) for a, b in zip(computed, table))
            comp_us, table_us = alternate(lambda p=positions: drafter.rope(p, drafter.fc.weight.dtype),
                                          lambda p=positions: prop.rope_at(p), args.repeats)
            rows.append({"op": "drafter RoPE", "shape": list(positions.shape), "computed_us": round(comp_us, 1),
                         "table_us": round(table_us, 1), "same": same})
    for r in rows:
        print(json.dumps(r))
    out = {"command": "python benchmarks/host_ops/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": cpu_description(), "threads": args.threads, "repeats": args.repeats, "rows": rows}
    if args.out:
        write_text_atomic(Path(args.out), json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
