"""The embedded pair and held-out prompts, loaded the same way by every script in this folder."""

from __future__ import annotations

from sglang_adaflash.assets import MODELS_DIR, WORKLOADS_DIR
from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.d2sd.cli import D2SDOptions, attach_recovery
from sglang_adaflash.engine.request import Request
from sglang_adaflash.launch.loading import load_pair
from sglang_adaflash.launch.prompts import read_prompts, resolve_prompt_ids

RECOVERY = str(MODELS_DIR / "recovery_drafter")


def load(device: str, dtype: str, requests: int, domains=("code", "prose"), d2sd: dict | None = None):
    """(pair, prompt ids): the first held-out prompts, split evenly over `domains`; with `d2sd`
    (D2SDOptions fields) the recovery drafter is attached too."""
    pair = load_pair(MODELS_DIR / "target", MODELS_DIR / "drafter", dtype=dtype, device=device)
    if d2sd is not None:
        attach(pair, d2sd)
    specs, left = [], requests
    for k, domain in enumerate(domains):
        take = left // (len(domains) - k)
        specs += read_prompts(WORKLOADS_DIR / f"{domain}.heldout.jsonl")[:take]
        left -= take
    return pair, [resolve_prompt_ids(s, pair.tokenizer) for s in specs]


def attach(pair, d2sd: dict) -> None:
    attach_recovery(pair, D2SDOptions(recovery_drafter=RECOVERY, **d2sd))


def make_requests(pair, prompts, max_new_tokens: int, temperature: float = 0.0) -> list[Request]:
    stop = tuple(pair.stop_token_ids)
    return [Request(list(p), SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop,
                                            temperature=temperature), f"r{i}") for i, p in enumerate(prompts)]
