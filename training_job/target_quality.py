"""How good is a target LM on the held-out workloads: perplexity, loops, math answers.

    python -m training_job.target_quality --target DIR [--workloads DIR] [--prompts N]
        [--max-new-tokens 64] [--temperature 0.7] [--top-p 0.95] [--seed 0] [--json] [--out FILE]

For every domain (code, math, prose) of the held-out workloads (by default the shipped ones,
``sglang_adaflash/assets/workloads``) it reports

- **perplexity** over the response tokens (and the stop token) of every held-out record, the
  prompt being context (:func:`training_job.target_lm.evaluate`, the same figure as the target's
  ``training_report.json``); ``--ppl-records N`` scores the first N records only;
- the **repeated-4-gram share** of the model's own continuations of the first ``--prompts``
  held-out prompts, greedy (T=0) and sampled (``--temperature``, ``--top-p``, seeded by
  ``--seed``), each at most ``--max-new-tokens`` tokens and cut before the first stop token;
- **math answer accuracy**: the share of math prompts whose greedy solution (up to
  ``--answer-max-new-tokens`` tokens, enough for the longest reference solution) states the
  right answer, read with :func:`training_job.data.math_problems.extract_answer`.

Repeated-4-gram share. For an output of token ids ``t_1 .. t_n`` its 4-grams are
``g_i = (t_i, t_i+1, t_i+2, t_i+3)`` for ``i = 1 .. n-3``; ``g_i`` *repeats* when it equals some
``g_j`` with ``j < i`` of the same output. An output's share is its repeating 4-grams over its
4-grams: ``a b c d a b c d`` has five 4-grams of which one (the second ``a b c d``) repeats, 0.2;
text that cycles with a short period scores close to 1, fresh text 0. The reported
``rep4_share`` is the mean of the outputs' shares over the outputs that have at least one 4-gram
(4 tokens or more), so every prompt weighs the same; ``rep4_pooled`` divides the repeating
4-grams of all outputs by all their 4-grams, so long outputs weigh more.

The model runs in float32 (bf16 weights are upcast), batched with left padding. Samples are
reproducible: the same target, prompts, ``--batch-size`` and ``--seed`` give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from sglang_adaflash.assets import chat_format as cf
from sglang_adaflash.bench.runner import recorded_path

from .data import DOMAINS, load_split
from .data.common import atomic_write_text
from .data.math_problems import extract_answer

FORMAT = "adaflash.target_quality/v1"


def repeated_ngrams(tokens: Sequence, n: int = 4) -> tuple[int, int]:
    """(repeating n-grams, n-grams) of one output: an n-gram repeats when it occurred earlier."""
    seen: set[tuple] = set()
    total = repeated = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        total += 1
        if gram in seen:
            repeated += 1
        else:
            seen.add(gram)
    return repeated, total


def repeated_ngram_share(outputs: Sequence[Sequence], n: int = 4,
                         how: str = "mean") -> float | None:
    """The repeated-n-gram share of ``outputs``: ``how="mean"`` averages each output's share
    (repeating n-grams / n-grams) over the outputs that have an n-gram; ``how="pooled"`` divides
    the repeating n-grams of all outputs by all their n-grams. None when no output has one."""
    counts = [c for c in (repeated_ngrams(out, n) for out in outputs) if c[1]]
    if not counts:
        return None
    if how == "mean":
        return sum(r / t for r, t in counts) / len(counts)
    if how == "pooled":
        return sum(r for r, _ in counts) / sum(t for _, t in counts)
    raise ValueError(f"how must be 'mean' or 'pooled', got {how!r}")


def answer_accuracy(texts: Sequence[str], answers: Sequence[int]) -> dict:
    """How many solutions state the expected answer (``extract_answer``), and how many none."""
    got = [extract_answer(t) for t in texts]
    correct = sum(g is not None and g == a for g, a in zip(got, answers))
    return {"correct": correct, "total": len(texts), "no_answer": sum(g is None for g in got),
            "accuracy": correct / len(texts) if texts else None}


# ---------------------------------------------------------------------------------------------
# Generation


def _stop_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.convert_tokens_to_ids(t) for t in cf.STOP_TOKENS)


def cut_at_stop(tokens: list[int], stop_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """The tokens before the first stop token, and whether there was one."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i], True
    return tokens, False


@torch.inference_mode()
def generate_batch(model, ids: list[list[int]], max_new_tokens: int, stops: tuple[int, ...],
                   pad: int, **sampling) -> list[tuple[list[int], bool]]:
    """Continue token-id prompts in one left-padded batch; per prompt the new tokens before the
    first stop token and whether it stopped. ``sampling`` holds ``generate()``'s sampling
    arguments (greedy when empty)."""
    width = max(len(x) for x in ids)
    x = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for r, p in enumerate(ids):
        x[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    kw = sampling or dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens,
                         eos_token_id=list(stops), pad_token_id=pad, **kw)
    return [cut_at_stop(gen[r, width:].tolist(), stops) for r in range(len(ids))]


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, *, batch_size: int = 16,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
             ) -> list[tuple[list[int], bool]]:
    """Continue each prompt (raw text, rendered in the chat format); per prompt the new tokens
    before the first stop token and whether it stopped. ``temperature`` 0 is greedy.

    Prompts are batched in order of length (less padding); the sampling RNG is seeded with
    ``seed + batch index`` before each batch.
    """
    stops = _stop_ids(tokenizer)
    ids = [tokenizer(cf.render_prompt(p), add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[tuple[list[int], bool] | None] = [None] * len(ids)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) \
        if temperature > 0 else {}
    for b, s in enumerate(range(0, len(order), batch_size)):
        rows = order[s:s + batch_size]
        if sampling:
            torch.manual_seed(seed + b)
        outs = generate_batch(model, [ids[i] for i in rows], max_new_tokens, stops,
                              tokenizer.pad_token_id, **sampling)
        for i, o in zip(rows, outs):
            out[i] = o
    return out  # type: ignore[return-value]


def _gen_stats(outs: list[tuple[list[int], bool]], n: int = 4) -> dict:
    toks = [t for t, _ in outs]
    counts = [repeated_ngrams(t, n) for t in toks]
    return {"rep4_share": repeated_ngram_share(toks, n, "mean"),
            "rep4_pooled": repeated_ngram_share(toks, n, "pooled"),
            "repeated_4grams": sum(r for r, _ in counts), "4grams": sum(t for _, t in counts),
            "outputs_with_4grams": sum(t > 0 for _, t in counts),
            "mean_tokens": sum(map(len, toks)) / len(toks) if toks else None,
            "stopped_share": sum(s for _, s in outs) / len(outs) if outs else None}


# ---------------------------------------------------------------------------------------------
# The report


def measure(target: Path, workloads: Path, domains: Sequence[str] = DOMAINS,
            prompts: int | None = None, ppl_records: int | None = None,
            max_new_tokens: int = 64, answer_max_new_tokens: int = 128,
            temperature: float = 0.7, top_p: float = 0.95, seed: int = 0,
            batch_size: int = 16, threads: int = 2, eval_max_len: int = 512,
            progress=None) -> dict:
    """Everything the module docstring lists, as one JSON-able dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .target_lm import response_loss

    say = progress or (lambda msg: None)
    torch.set_num_threads(threads)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    report: dict = {
        # paths as recorded in committed results: relative, or <embedded>/..., never this machine's
        "format": FORMAT, "target": recorded_path(target), "workloads": recorded_path(workloads),
        "settings": {"prompts": prompts, "ppl_records": ppl_records,
                     "max_new_tokens": max_new_tokens,
                     "answer_max_new_tokens": answer_max_new_tokens,
                     "temperature": temperature, "top_p": top_p, "seed": seed,
                     "batch_size": batch_size, "threads": threads, "dtype": "float32",
                     "eval_max_len": eval_max_len, "ngram": 4},
        "domains": {},
    }
    for d in domains:
        recs = load_split(workloads, d, "heldout")
        scored = recs[:ppl_records] if ppl_records else recs
        say(f"{d}: perplexity over {len(scored)} records")
        pl = response_loss(model, tokenizer, scored, eval_max_len)
        model.eval()
        gen_recs = recs[:prompts] if prompts else recs
        texts = [r["prompt"] for r in gen_recs]
        is_math = d == "math" and all("answer" in r for r in gen_recs)
        greedy_len = max(max_new_tokens, answer_max_new_tokens) if is_math else max_new_tokens
        say(f"{d}: greedy on {len(texts)} prompts")
        greedy_full = generate(model, tokenizer, texts, greedy_len, batch_size=batch_size)
        # Greedy decoding is prefix-consistent: its first max_new_tokens tokens are what a
        # max_new_tokens run writes (a stop inside them counts; one after them does not).
        greedy = [(t[:max_new_tokens], s and len(t) < max_new_tokens) for t, s in greedy_full]
        say(f"{d}: sampling T={temperature} top-p {top_p} on {len(texts)} prompts")
        sampled = generate(model, tokenizer, texts, max_new_tokens, batch_size=batch_size,
                           temperature=temperature, top_p=top_p, seed=seed)
        entry = {"ppl": pl["ppl"], "loss": pl["loss"], "ppl_tokens": pl["tokens"],
                 "ppl_records": len(scored), "prompts": len(texts),
                 "greedy": _gen_stats(greedy), "sampled": _gen_stats(sampled)}
        if is_math:
            sols = [tokenizer.decode(t, skip_special_tokens=True) for t, _ in greedy_full]
            entry["math_answers"] = answer_accuracy(sols, [int(r["answer"]) for r in gen_recs])
        entry["examples"] = {"prompt": texts[0],
                             "greedy": tokenizer.decode(greedy[0][0], skip_special_tokens=True),
                             "sampled": tokenizer.decode(sampled[0][0], skip_special_tokens=True)}
        report["domains"][d] = entry
    report["wall_s"] = round(time.time() - t0, 1)
    return report


def _fmt(x, spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}}" if x is None else format(x, spec)


def format_table(report: dict) -> str:
    s = report["settings"]
    t = f"T={s['temperature']}"
    lines = [f"target {report['target']}  (workloads {report['workloads']})",
             f"{'domain':<7} {'ppl':>8} {'rep4 T=0':>9} {'(pooled)':>9} {'rep4 ' + t:>10} "
             f"{'(pooled)':>9} {'answers':>8} {'prompts':>8} {'ppl tokens':>11}"]
    for d, e in report["domains"].items():
        acc = e.get("math_answers")
        g, x = e["greedy"], e["sampled"]
        lines.append(
            f"{d:<7} {_fmt(e['ppl'], '8.2f')} {_fmt(g['rep4_share'], '9.3f')} "
            f"{_fmt(g['rep4_pooled'], '9.3f')} {_fmt(x['rep4_share'], '10.3f')} "
            f"{_fmt(x['rep4_pooled'], '9.3f')} {_fmt(acc['accuracy'] if acc else None, '8.3f')} "
            f"{e['prompts']:>8} {e['ppl_tokens']:>11}")
    lines.append(f"rep4: per output, the share of its 4-grams (token ids) that repeat an earlier "
                 f"one, mean over outputs (pooled: over all 4-grams); {s['max_new_tokens']} new "
                 f"tokens at most; sampled with top-p {s['top_p']}, seed {s['seed']}. answers: "
                 f"greedy math accuracy ({s['answer_max_new_tokens']} tokens). "
                 f"{report['wall_s']} s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from sglang_adaflash import assets

    ap = argparse.ArgumentParser(prog="python -m training_job.target_quality",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="HF model directory")
    ap.add_argument("--workloads", type=Path, default=assets.ASSETS_DIR / "workloads",
                    help="folder with {code,math,prose}.heldout.jsonl (default: the shipped)")
    ap.add_argument("--domains", default=",".join(DOMAINS))
    ap.add_argument("--prompts", type=int, default=None,
                    help="generate for the first N held-out prompts per domain (default: all)")
    ap.add_argument("--ppl-records", type=int, default=None,
                    help="perplexity over the first N held-out records per domain (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--answer-max-new-tokens", type=int, default=128,
                    help="greedy length for the math answers (longest reference: 90 tokens)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the JSON report, not the table")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    domains = [d for d in args.domains.split(",") if d]
    unknown = set(domains) - set(DOMAINS)
    if unknown:
        ap.error(f"unknown domains {sorted(unknown)}: choose from {', '.join(DOMAINS)}")
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (greedy is always reported)")
    say = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    report = measure(args.target, args.workloads, domains, args.prompts, args.ppl_records,
                     args.max_new_tokens, args.answer_max_new_tokens, args.temperature,
                     args.top_p, args.seed, args.batch_size, args.threads, progress=say)
    report["command"] = "python -m training_job.target_quality " + " ".join(
        sys.argv[1:] if argv is None else argv)
    text = json.dumps(report, indent=2, allow_nan=False)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
