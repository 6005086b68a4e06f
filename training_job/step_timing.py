"""Measure what one target step and one drafter step cost on this machine.

    python -m training_job.step_timing --target DIR [--context 256] [--block 16] [--repeats 30]

It times, at batch 1 with a warm KV cache of ``--context`` tokens:

- target decode: one new token through the whole target (plain autoregressive step);
- target verify: a block of ``--block`` tokens through the whole target (the spec-decode verify);
- drafter step: a DFlash drafter of 1 and of 2 layers at the target's hidden size (random
  weights: cost does not depend on them) over one block, attending to ``--context`` cached
  context features, plus the target's LM head over the block;
- the same drafter code with as many layers as the target: the target's per-step compute
  without Hugging Face's per-call overhead.

Medians over ``--repeats`` runs after warm-up; the machine is shared, so medians, not means.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000.0 * statistics.median(ts)


@torch.no_grad()
def time_target(model, context: int, block: int, repeats: int) -> dict[str, float]:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ctx = torch.randint(8, vocab, (1, context))
    base = DynamicCache(config=model.config)
    model(input_ids=ctx, past_key_values=base, use_cache=True)

    def step(n: int):
        cache = DynamicCache(config=model.config)
        for i, layer in enumerate(base.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), i)
        ids = torch.randint(8, vocab, (1, n))
        pos = torch.arange(context, context + n)[None]
        t = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
        return time.perf_counter() - t

    out = {}
    for name, n in (("target_decode_ms", 1), ("target_verify_ms", block)):
        for _ in range(3):
            step(n)
        out[name] = 1000.0 * statistics.median(step(n) for _ in range(repeats))
    return out


@torch.no_grad()
def drafter_step(target, layers: int, context: int, block: int, intermediate_size: int | None = None,
                 layer_ids: list[int] | None = None):
    """One drafter decode step as a callable: a DFlash drafter of ``layers`` layers at the
    target's sizes (MLP ``intermediate_size``, default the target's; random weights: the cost
    does not depend on them) over one block attending to ``context`` cached context features,
    plus the target's LM head over the block and the argmax."""
    from sglang_adaflash.assets import chat_format as cf
    from sglang_adaflash.drafter.config import DrafterConfig, default_target_layer_ids
    from sglang_adaflash.drafter.model import DFlashDrafter

    tc = target.config
    cfg = DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
        vocab_size=tc.vocab_size, num_target_layers=tc.num_hidden_layers,
        mask_token_id=cf.SPECIAL_TOKENS.index(cf.MASK),
        target_layer_ids=layer_ids or default_target_layer_ids(tc.num_hidden_layers, layers),
        block_size=block,
    )
    drafter = DFlashDrafter(cfg).eval()
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    k = len(cfg.target_layer_ids)
    feats = drafter.project_context(torch.randn(1, context, k * tc.hidden_size))
    ctx_kv = drafter.context_kv(feats, torch.arange(context)[None])
    ids = torch.full((1, block), cfg.mask_token_id)
    pos = torch.arange(context, context + block)[None]
    mask = torch.ones(1, 1, block, context + block, dtype=torch.bool)

    @torch.no_grad()
    def step():
        h = drafter(drafter.embed_tokens(ids), pos, ctx_kv, mask)
        drafter.logits(h[:, 1:]).argmax(-1)

    return step


def time_drafter(target, layers: int, context: int, block: int, repeats: int) -> float:
    return _median_ms(drafter_step(target, layers, context, block), repeats)


def measure(target_dir: Path, context: int, block: int, repeats: int, threads: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    out = {"context": context, "block": block, "threads": threads, "dtype": "float32"}
    out.update(time_target(target, context, block, repeats))
    n = target.config.num_hidden_layers
    # The same layer code with as many layers as the target: the target's compute without the
    # HF Python overhead, so the ratio below is the honest one.
    for layers in (1, 2, n):
        out[f"drafter_{layers}l_step_ms"] = time_drafter(target, layers, context, block, repeats)
    out["target_sized_stack_over_drafter_1l"] = (out[f"drafter_{n}l_step_ms"]
                                                 / out["drafter_1l_step_ms"])
    out["verify_over_drafter_1l"] = out["target_verify_ms"] / out["drafter_1l_step_ms"]
    out["decode_over_drafter_1l"] = out["target_decode_ms"] / out["drafter_1l_step_ms"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training_job.step_timing")
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.target, args.context, args.block, args.repeats, args.threads),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
