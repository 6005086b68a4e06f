"""The offline recipe's data: the target's own greedy answers to the training prompts.

The drafter learns to predict what the target says, not what the corpus says, so every
training sequence is the prompt and the target's greedy continuation (regenerated in batches,
cached in a JSON-lines file that a rerun resumes from and a torn last line does not break).
`continuation_contexts` gives further passes: contexts cut from the responses already
generated, answered again, for more target-generated data per prompt.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from sglang_adaflash.assets import chat_format as cf

from .data.common import read_jsonl


def regenerate(target, tokenizer, records: list[dict], out_path: Path, max_new_tokens: int,
               batch_size: int, progress: bool = True) -> list[dict]:
    """Greedy target responses for ``records``; appends to ``out_path`` and resumes from it.

    Each line: ``id``, ``domain``, ``prompt_ids``, ``output_ids`` (up to and including the stop
    token, if the target stopped), like the traffic record format.
    """
    stop_ids = {tokenizer.convert_tokens_to_ids(t) for t in cf.STOP_TOKENS}
    items = [(r["id"], r["domain"], tokenizer(cf.render_prompt(r["prompt"]), add_special_tokens=False)
              ["input_ids"]) for r in records]
    return generate_greedy(target, items, out_path, max_new_tokens, stop_ids, batch_size, progress)


def continuation_contexts(tokenizer, records: list[dict], max_context: int = 400,
                          pass_: int = 0) -> list[tuple]:
    """``(id, domain, context ids)`` per record: its prompt and its reference response cut at a
    point drawn from the record's id and ``pass_`` (so a rebuild cuts the same place, and each
    pass somewhere else), the last ``max_context`` tokens of that. The target continues these
    greedily: data from the middle of responses and from longer contexts than a prompt alone
    gives (acceptance falls with context length: benchmarks/adaptive/context/)."""
    out = []
    for r in records:
        prompt = tokenizer(cf.render_prompt(r["prompt"]), add_special_tokens=False)["input_ids"]
        resp = tokenizer(r["response"], add_special_tokens=False)["input_ids"]
        if len(resp) < 16:
            continue
        tag = "" if pass_ == 0 else str(pass_)  # pass 0 keeps the first recipe's ids and cuts
        cut = random.Random(f"{r['id']}-cut{tag}").randint(8, len(resp) - 4)
        out.append((f"{r['id']}#cont{tag}", r["domain"], (prompt + resp[:cut])[-max_context:]))
    return out


@torch.no_grad()
def generate_greedy(target, items: list[tuple], out_path: Path, max_new_tokens: int, stop_ids,
                    batch_size: int, progress: bool = True) -> list[dict]:
    """The target's greedy continuation of each ``(id, domain, prompt ids)``, with the reference
    engine in mode ``ar`` (continuous batching: 5-10x HF ``generate`` with left padding here,
    and token for token the same output, tests/engine/test_lossless_greedy.py). Appends one
    line per item to ``out_path`` (fsynced per batch) and resumes from what is there."""
    from tqdm.auto import tqdm

    from sglang_adaflash.core.sampling import SamplingParams
    from sglang_adaflash.engine.engine import SpecEngine
    from sglang_adaflash.engine.request import Request
    from sglang_adaflash.target.hf_target import HFTarget

    out_path = Path(out_path)
    done = {}
    if out_path.exists():
        for r in _read_tolerant(out_path):
            done[r["id"]] = r
    limit = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
    new_tokens = max(1, min(max_new_tokens, limit - 1))
    # a context longer than the target's window keeps its last tokens (the shipped target's
    # prompts all fit: at most 356 of its 512 positions)
    todo = [(i, d, list(p)[-(limit - new_tokens):]) for i, d, p in items if i not in done]
    engine = SpecEngine(HFTarget(target), None, mode="ar", max_batch_size=max(1, batch_size),
                        max_seq_len=max((len(p) for _, _, p in todo), default=1) + new_tokens)
    stops = tuple(sorted(stop_ids))
    bar = tqdm(total=len(todo), desc="regenerate", disable=not progress, dynamic_ncols=True)
    chunk = 4 * max(1, batch_size)  # a write and fsync per chunk; the engine refills its slots
    with open(out_path, "a", encoding="utf-8") as f:
        for i in range(0, len(todo), chunk):
            part = todo[i:i + chunk]
            reqs = [Request(p, SamplingParams(max_new_tokens=new_tokens, stop_token_ids=stops))
                    for _, _, p in part]
            for (rid, domain, p), o in zip(part, engine.run(reqs)):
                rec = {"id": rid, "domain": domain, "prompt_ids": p, "output_ids": o.output_ids}
                done[rid] = rec
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(part))
    bar.close()
    return [done[it[0]] for it in items]


def _read_tolerant(path: Path):
    """JSONL records, skipping a torn last line (a killed run)."""
    try:
        yield from read_jsonl(path)
    except json.JSONDecodeError:
        good = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    good.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        yield from good


# ---------------------------------------------------------------------------------------------
# 2. Blocks and the drafter loss (pure functions; tests call them directly)
