"""How well can a rule tell, before drafting, whether a request's next block will accept anything?

The oracle's ceiling comes from drafting exactly the steps that accept at least one proposal;
`adaflash` plans from each request's history (its own and its domain's acceptance), which knows a
request's average, not its next step. This measures the signals a rule could read before the
drafter runs, on `dflash` runs (every step drafted, block 16, T=0, c=1) over held-out code and
prose prompts, as the area under the ROC curve (AUC; 0.5 is no signal, 1 a perfect one) for
"the next block accepts >= 1 proposal":

- the previous block's accepted count (what history sees, at its most recent);
- the target's confidence in the last committed token (its top probability there);
- a ridge-regularised logistic probe on the target's features at the last committed token (the
  layers the drafter reads, plus the previous count), fitted on half of the requests and scored
  on the other half (requests alternate between the halves).

    python benchmarks/adaptive/step_signal.py --per-domain 80 --out benchmarks/adaptive/step_signal.json
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

from sglang_adaflash.assets import MODELS_DIR, WORKLOADS_DIR  # noqa: E402
from sglang_adaflash.bench.runner import recorded_path  # noqa: E402
from sglang_adaflash.core.sampling import SamplingParams  # noqa: E402
from sglang_adaflash.engine.request import Request  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.engine_factory import make_engine  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.launch.prompts import read_prompts, resolve_prompt_ids  # noqa: E402


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """Mann-Whitney AUC of score for the positive labels (ties broken by order)."""
    ranks = np.empty(len(score))
    ranks[np.argsort(score, kind="stable")] = np.arange(len(score))
    pos, neg = int(label.sum()), int((~label).sum())
    return float((ranks[label].sum() - pos * (pos - 1) / 2) / (pos * neg))


def fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float, iters: int = 50) -> np.ndarray:
    """Newton's method for ridge-penalised logistic regression; x carries its own bias column."""
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-x @ w))
        hess = x.T @ (x * (p * (1 - p))[:, None]) + ridge * np.eye(len(w))
        w -= np.linalg.solve(hess, x.T @ (p - y) + ridge * w)
    return w


def steps(pair, specs, max_new_tokens: int):
    """Per decode step of dflash runs: (features at the last committed token, the target's
    confidence in it, the previous step's accepted count, accepted count, request index)."""
    prompts = [(resolve_prompt_ids(s, pair.tokenizer), s.domain) for s in specs]
    max_seq = max(len(p) for p, _ in prompts) + max_new_tokens
    eng = make_engine(pair, "dflash", 1, max_seq, 0, num_requests=len(prompts))
    outs = eng.run([Request(list(p), SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(pair.stop_token_ids)),
                            f"r{i}", d) for i, (p, d) in enumerate(prompts)])
    layers = list(pair.drafter.config.target_layer_ids)
    rows = []
    for req, o in enumerate(outs):
        ids = list(o.prompt_ids) + list(o.output_ids)
        with torch.inference_mode():
            got = pair.target.model(torch.tensor([ids]), output_hidden_states=True)
        feats = torch.cat([got.hidden_states[i + 1][0] for i in layers], -1).float().numpy()
        conf = got.logits[0].float().softmax(-1).max(-1).values.numpy()  # conf[t]: top probability for token t+1
        last, prev = len(o.prompt_ids), -1  # the last committed token's index; -1: no block yet
        for tau in o.stats.accept_lens:
            rows.append((feats[last], float(conf[last - 1]), prev, tau - 1, req))
            prev, last = tau - 1, last + tau
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-domain", type=int, default=80, help="held-out code and prose prompts each")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ridge", type=float, nargs="+", default=[10.0, 100.0, 1000.0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    pair = load_pair(MODELS_DIR / "target", str(MODELS_DIR / "drafter"), dtype="float32")
    specs = [s for d in ("code", "prose") for s in read_prompts(str(WORKLOADS_DIR / f"{d}.heldout.jsonl"))[: args.per_domain]]
    rows = steps(pair, specs, args.max_new_tokens)
    feats = np.stack([r[0] for r in rows])
    conf, prev = np.array([r[1] for r in rows]), np.array([r[2] for r in rows], dtype=np.float64)
    label, req = np.array([r[3] >= 1 for r in rows]), np.array([r[4] for r in rows])
    x = np.hstack([feats, prev[:, None]])
    train, test = req % 2 == 0, req % 2 == 1
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-6
    z = np.hstack([(x - mu) / sd, np.ones((len(x), 1))])
    probe = {}
    for lam in args.ridge:
        w = fit_logistic(z[train], label[train].astype(np.float64), lam)
        probe[str(lam)] = {"test_auc": auc(z[test] @ w, label[test]), "train_auc": auc(z[train] @ w, label[train])}
    # ties in the previous count are broken by the confidence, which is continuous
    out = {
        "steps": len(rows), "requests": len(specs), "share_accepting": float(label.mean()),
        "auc_previous_count": auc(prev[test] + 1e-6 * conf[test], label[test]),
        "auc_target_confidence": auc(conf[test], label[test]),
        "auc_probe_by_ridge": probe,
        "share_accepting_after_a_failed_block": float(label[prev == 0].mean()),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        given = list(argv if argv is not None else sys.argv[1:])
        given[given.index("--out") + 1] = recorded_path(args.out)
        write_text_atomic(args.out, json.dumps({"command": "benchmarks/adaptive/step_signal.py " + " ".join(given),
                                                **out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
