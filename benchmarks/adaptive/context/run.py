"""Acceptance against context length on the shipped pair: tau, and the length head's prediction.

The AdaFlash paper leaves open how acceptance moves with context length. This measures it on the
embedded pair. The target stops within about 100 tokens of a single held-out prompt, so longer
contexts are built the way the target saw them in training (whole conversations packed one after
another in 512-token windows): before each held-out prompt go other held-out conversations of the
same domain (prompt, reference response, stop token), as many as fit in a history budget
(`--history`, tokens). Each context is continued greedily by the target (`ar`) up to the target's
context limit (prompt plus generated tokens <= max_position_embeddings) or its stop token. Then, at every committed position m of that continuation, the drafter drafts one block
exactly as a decode step would (block slot 0 holds output[m-1], its context is the target's
features of everything before it), in one batched forward per prompt, and we record

- tau(m): 1 + the drafter's leading proposals equal to the target's next greedy tokens (what a
  `dflash` step starting there commits; at T=0 this is exact, with no sampling noise);
- the length head's prediction for that block, ratio * B (its estimate of tau for the block);

binned by context length (prompt + m). Blocks whose lookahead runs past a continuation cut by the
length limit are left out (their acceptance is censored); blocks that reach a stop token count.

    python benchmarks/adaptive/context/run.py --out benchmarks/adaptive/context/results.json

(defaults: --per-domain 12 --history 0,128,256,384 --bin 64 --threads 2; the plot is written
beside --out.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR, WORKLOADS_DIR  # noqa: E402
from sglang_adaflash.assets import chat_format as cf  # noqa: E402
from sglang_adaflash.bench.runner import recorded_path  # noqa: E402
from sglang_adaflash.core.sampling import SamplingParams  # noqa: E402
from sglang_adaflash.engine.proposer import DFlashProposer  # noqa: E402
from sglang_adaflash.engine.request import Request  # noqa: E402
from sglang_adaflash.fsio import write_text_atomic  # noqa: E402
from sglang_adaflash.launch.engine_factory import make_engine  # noqa: E402
from sglang_adaflash.launch.loading import load_pair  # noqa: E402
from sglang_adaflash.target.hf_target import TargetBatch  # noqa: E402

DOMAINS = ("code", "prose", "math")


@torch.inference_mode()
def blocks_along(pair, prompt: list[int], output: list[int], stopped: bool) -> list[dict]:
    """One record per committed position m >= 1 whose block can be judged: context length,
    tau of a block drafted there, and the head's ratio * B for it."""
    target, drafter = pair.target, pair.drafter
    b = drafter.config.block_size
    seq = prompt + output
    drafter.share_target_modules(target.embed_tokens, target.lm_head)  # as every engine does
    target.capture_layer_ids = list(drafter.config.target_layer_ids)
    _, aux = target.forward(TargetBatch.from_lists([seq], [0]), target.new_cache(1, len(seq) + 1))
    proposer = DFlashProposer(drafter, num_slots=1, capacity=len(seq) + b + 1)
    proposer.extend_context(aux[None], torch.zeros(1, dtype=torch.long), [0])
    # a block at m is judged when its whole lookahead is known: B-1 tokens ahead, or the stop
    last_m = len(output) - 1 if stopped else len(output) - (b - 1)
    out = []
    for chunk in torch.arange(1, max(last_m, 1) + 1).split(64):
        if chunk.numel() == 0 or int(chunk[0]) > last_m:
            break
        last = torch.tensor(output)[chunk - 1]
        hidden = proposer.propose(last, len(prompt) + chunk - 1, slots=[0] * len(chunk))  # [M, B, H]
        props = drafter.logits(hidden[:, 1:]).argmax(-1).tolist()
        ratio = drafter.length_head(hidden).tolist() if drafter.length_head is not None else [None] * len(chunk)
        for m, p, r in zip(chunk.tolist(), props, ratio):
            ahead, a = output[m:], 0
            while a < min(len(p), len(ahead)) and p[a] == ahead[a]:
                a += 1
            out.append({"context": len(prompt) + m - 1, "tau": a + 1, "head_tau": None if r is None else r * b})
    return out


def with_history(pair, records: list[dict], i: int, budget: int) -> list[int]:
    """Record i's prompt after other records' whole conversations, at most `budget` tokens of them."""
    tok = pair.tokenizer
    prompt = tok(cf.render_prompt(records[i]["prompt"]), add_special_tokens=False)["input_ids"]
    history: list[int] = []
    for j in range(1, len(records)):
        r = records[(i + j) % len(records)]
        conv = tok(cf.render_example(r["prompt"], r["response"]), add_special_tokens=False)["input_ids"]
        if len(history) + len(conv) > budget:
            break
        history += conv
    return history + prompt


def _pearson(x: list[float], y: list[float]) -> float | None:
    """Correlation of the head's estimate with the block's tau, block by block."""
    try:
        return round(statistics.correlation(x, y), 3)
    except statistics.StatisticsError:  # a constant column
        return None


def summarize(blocks: list[dict], width: int) -> list[dict]:
    bins: dict[int, list[dict]] = {}
    for x in blocks:
        bins.setdefault(x["context"] // width, []).append(x)
    rows = []
    for k in sorted(bins):
        xs = bins[k]
        taus = [x["tau"] for x in xs]
        heads = [x["head_tau"] for x in xs if x["head_tau"] is not None]
        row = {"context_from": k * width, "context_to": (k + 1) * width, "blocks": len(xs),
               "tau": round(statistics.fmean(taus), 3)}
        if heads:
            row["head_tau"] = round(statistics.fmean(heads), 3)
            row["head_bias"] = round(row["head_tau"] - row["tau"], 3)  # + : the head expects more
            row["head_mae"] = round(statistics.fmean(abs(x["head_tau"] - x["tau"]) for x in xs), 3)
            row["head_pearson"] = _pearson(heads, taus) if len(xs) >= 20 else None
        rows.append(row)
    return rows


def plot(path: Path, table: dict, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (domain, rows) in enumerate(table.items()):
        rows = [r for r in rows if r["blocks"] >= 20]
        mid = [(r["context_from"] + r["context_to"]) / 2 for r in rows]
        color = f"C{i}"
        ax.plot(mid, [r["tau"] for r in rows], "o-", color=color, label=f"{domain}: tau")
        if rows and "head_tau" in rows[0]:
            ax.plot(mid, [r["head_tau"] for r in rows], "x--", color=color, label=f"{domain}: head's ratio x B")
    ax.set_xlabel("context length (prompt + generated tokens) at the block")
    ax.set_ylabel("tokens committed per dflash step")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--per-domain", type=int, default=12)
    ap.add_argument("--history", default="0,128,256,384", help="history budgets (tokens) before each prompt")
    ap.add_argument("--bin", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default=str(TARGET_DIR))
    ap.add_argument("--drafter", default=str(DRAFTER_DIR))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(args.target, args.drafter, dtype="float32")
    limit = int(pair.target.config.max_position_embeddings)
    stop = tuple(pair.stop_token_ids)
    blocks: dict[str, list[dict]] = {}
    generated = {}
    for domain in DOMAINS:
        records = [json.loads(x) for x in (WORKLOADS_DIR / f"{domain}.heldout.jsonl").read_text().splitlines() if x]
        prompts = [with_history(pair, records, i, int(h)) for h in args.history.split(",")
                   for i in range(args.per_domain)]
        prompts = [p for p in prompts if len(p) < limit - 16]
        eng = make_engine(pair, "ar", 16, limit, 0, num_requests=len(prompts))
        reqs = [Request(p, SamplingParams(max_new_tokens=limit - len(p), stop_token_ids=stop), f"{domain}{i}")
                for i, p in enumerate(prompts)]
        outs = eng.run(reqs)
        blocks[domain] = [x for p, o in zip(prompts, outs)
                          for x in blocks_along(pair, p, o.output_ids, o.finish_reason == "stop")]
        generated[domain] = {"prompts": len(prompts), "mean_prompt": round(statistics.fmean(map(len, prompts)), 1),
                             "mean_generated": round(statistics.fmean(len(o.output_ids) for o in outs), 1),
                             "stopped": sum(o.finish_reason == "stop" for o in outs)}
        print(domain, generated[domain], flush=True)
    table = {d: summarize(xs, args.bin) for d, xs in blocks.items()}
    overall = {d: summarize(xs, 10**6)[0] for d, xs in blocks.items() if xs}
    result = {
        "command": " ".join(["python benchmarks/adaptive/context/run.py",
                             *[recorded_path(a) for a in (argv or sys.argv[1:])]]),
        "settings": {"per_domain": args.per_domain, "bin": args.bin, "context_limit": limit,
                     "block_size": pair.drafter.config.block_size, "dtype": "float32", "temperature": 0.0,
                     "drafter": recorded_path(args.drafter), "target": recorded_path(args.target)},
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "generated": generated,
        "overall": overall,
        "by_domain": table,
    }
    write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
    plot(args.out.with_suffix(".png"), table,
         "Acceptance against context length (embedded pair, T=0, block 16): dflash tau and the head's estimate")
    for d, rows in table.items():
        for r in rows:
            print(d, json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
