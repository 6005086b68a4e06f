"""How much of a draft's fate can be known before drafting: the ceiling of a draft-or-not rule.

The oracle (oracle.py) knows, at every row-step, how many proposals the target will accept, and
its throughput is the ceiling of any verify-length rule. A rule must decide whether to draft a
row before the drafter has run, from what it can read then: the request's history (what its
earlier drafts accepted), its domain's, and what the last verify showed (the target's confidence
in the token it just committed). This script measures how much of the per-step variation those
signals carry, at T=0 on one workload of the adaptive benchmark's prompts, from the oracle's
table (`foresee`: the accepted count at every position of every request's `ar` output):

- `lag_correlation`: the accepted count at a position against the count k positions on, in the
  same request (k = 1 shares most of a block; a rule's next decision after a drafted step is a
  few tokens on, and after an undrafted one a token on);
- `request_share`: the share of the accepted count's variance that lies between requests (what
  a perfect per-request rate could know) rather than within one, over the workload and within
  each domain (the part a per-domain rate cannot know);
- `chain`: a request drafted at every step with its whole block verified (each step advances by
  its accepted count plus one): the next step's accepted count by the last step's, and the
  correlation of the next count with the last one and with the mean of the last five;
- `by_target_confidence`: the accepted count by the target's probability of the token it
  committed last (its top probability: T=0), the one signal the verify hands over for free.

    python benchmarks/adaptive/signals.py --workload in_domain --out benchmarks/adaptive/signals/in_domain.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks" / "adaptive"))

from oracle import foresee  # noqa: E402
from run import cell_engine, cell_requests, one_cell  # noqa: E402

from sglang_adaflash.bench.machine import cpu_description  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.target.hf_target import TargetBatch  # noqa: E402

LAGS = (1, 2, 4, 8, 16, 32)
CONFIDENCE_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0 + 1e-9)


def _corr(x, y) -> float | None:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 3 or x.std() == 0 or y.std() == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def lag_correlation(tables: list[list[int]], lags=LAGS) -> dict[int, float | None]:
    """{k: correlation of accepted[m] with accepted[m + k]} over positions m >= 1 of each table."""
    out = {}
    for k in lags:
        x, y = [], []
        for t in tables:
            a = t[1:]
            if len(a) <= k:  # a request that stopped within k tokens has no such pair
                continue
            x.extend(a[: len(a) - k])
            y.extend(a[k:])
        out[k] = _corr(x, y)
    return out


def request_share(tables: list[list[int]]) -> float:
    """Between-request variance of the accepted count over its total variance (positions >= 1)."""
    rows = [t[1:] for t in tables if len(t) > 1]
    allv = np.concatenate([np.asarray(r, dtype=np.float64) for r in rows])
    means = np.array([np.mean(r) for r in rows])
    sizes = np.array([len(r) for r in rows])
    total = allv.var()
    return float(np.average((means - allv.mean()) ** 2, weights=sizes) / total) if total > 0 else 0.0


def chain(tables: list[list[int]], history: int = 5) -> dict:
    """Every request drafted at every step, its whole block verified: pairs of consecutive steps'
    accepted counts (a step at position m goes on at m + accepted + 1)."""
    last, nxt, past = [], [], []
    for t in tables:
        m, seen = 1, []
        while m < len(t):
            a = t[m]
            if seen:
                last.append(seen[-1])
                nxt.append(a)
                past.append(float(np.mean(seen[-history:])))
            seen.append(a)
            m += a + 1
    last_a, next_a = np.array(last), np.array(nxt)
    by_last = {int(v): {"steps": int((last_a == v).sum()), "next_mean": float(next_a[last_a == v].mean()),
                        "next_any": float((next_a[last_a == v] >= 1).mean())} for v in np.unique(last_a)}
    return {"pairs": len(nxt), "next_mean": float(next_a.mean()) if nxt else None,
            "corr_last": _corr(last, nxt), f"corr_mean_of_last_{history}": _corr(past, nxt), "by_last": by_last}


def by_target_confidence(tables: list[list[int]], confidence: list[list[float]], bins=CONFIDENCE_BINS) -> list[dict]:
    """The accepted count at position m by confidence[m] (the target's probability of the token at
    m - 1), per bin [lo, hi)."""
    a = np.array([v for t in tables for v in t[1:]], dtype=np.float64)
    p = np.array([v for c in confidence for v in c[1:]], dtype=np.float64)
    out = []
    for lo, hi in zip(bins[:-1], bins[1:]):
        sel = (p >= lo) & (p < hi)
        if sel.any():
            out.append({"lo": lo, "hi": min(hi, 1.0), "positions": int(sel.sum()), "accepted_mean": float(a[sel].mean()),
                        "accepted_any": float((a[sel] >= 1).mean())})
    return out


@torch.inference_mode()
def target_confidence(pair, prompt: list[int], output: list[int]) -> list[float]:
    """c[m] (m >= 1): the target's probability of output[m - 1] where it predicted it; c[0] = nan."""
    seq = prompt + output
    logits, _ = pair.target.forward(TargetBatch.from_lists([seq], [0]), pair.target.new_cache(1, len(seq) + 1))
    probs = torch.softmax(logits.reshape(len(seq), -1).double(), -1)
    at = torch.arange(len(prompt) - 1, len(seq) - 1)  # the position predicting output[j]
    got = probs[at, torch.tensor(output)].tolist()
    return [float("nan")] + got[: len(output) - 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="in_domain", choices=("in_domain", "math", "mixed"))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    pair, prompts, n, max_seq = one_cell(args.workload, 1)
    ar = cell_engine(pair, "ar", 1, prompts, n, max_seq)
    outs = ar.run(cell_requests(prompts, len(prompts), 64, tuple(pair.stop_token_ids)))  # each prompt once
    block = pair.drafter.config.block_size
    tables, confidence = [], []
    for o in outs:
        tables.append(foresee(pair, o.prompt_ids, o.output_ids, block_size=block))
        confidence.append(target_confidence(pair, o.prompt_ids, o.output_ids))
    doc = {
        "command": " ".join(["benchmarks/adaptive/signals.py", *(sys.argv[1:] if argv is None else argv)]),
        "environment": {"cpu": cpu_description()},
        "workload": args.workload, "requests": len(tables), "positions": sum(len(t) - 1 for t in tables),
        "accepted_mean": float(np.mean([v for t in tables for v in t[1:]])),
        "lag_correlation": lag_correlation(tables), "request_share": request_share(tables),
        "request_share_by_domain": {d: request_share([t for t, o in zip(tables, outs) if o.domain == d])
                                    for d in sorted({o.domain for o in outs})},
        "chain": chain(tables), "by_target_confidence": by_target_confidence(tables, confidence),
    }
    print(json.dumps({k: v for k, v in doc.items() if k not in ("chain", "by_target_confidence")}, indent=1))
    print("chain:", {k: v for k, v in doc["chain"].items() if k != "by_last"})
    for r in doc["by_target_confidence"]:
        print(f"  target p in [{r['lo']:.2f}, {r['hi']:.2f}): {r['positions']:>5} positions, "
              f"accepted {r['accepted_mean']:.2f}, any {r['accepted_any']:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.out), json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
