"""The demo's last word: at T=0 the final drafter version's answers are plain decoding's.

The served side is the running server (final version loaded, the answers' token ids asked for
with ``return_token_ids``); the reference is the target alone (mode ``ar``) in this process,
fed the same prompt ids the server built (the tokenizer's chat template, as the server renders
``/v1/chat/completions``). A single differing token fails the demo.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Equality:
    compared: int = 0
    equal: int = 0
    mismatches: list[dict] = field(default_factory=list)  # {id, first_difference, served, reference}

    @property
    def ok(self) -> bool:
        return self.compared > 0 and self.equal == self.compared

    def to_dict(self) -> dict:
        return {"ok": self.ok, "compared": self.compared, "equal": self.equal,
                "mismatches": self.mismatches}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(served: dict[str, list[int]], reference: dict[str, list[int]]) -> Equality:
    """Token-for-token comparison; a prompt missing on either side is a mismatch."""
    eq = Equality()
    for key in sorted(set(served) | set(reference)):
        eq.compared += 1
        a, b = served.get(key), reference.get(key)
        at = None if a is not None and b is not None and a == b else (
            first_difference(a, b) if a is not None and b is not None else 0)
        if at is None:
            eq.equal += 1
        else:
            eq.mismatches.append({"id": key, "first_difference": at,
                                  "served": None if a is None else a[at: at + 8],
                                  "reference": None if b is None else b[at: at + 8]})
    return eq


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids the server builds for one user message (see ``server/app.py``)."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def ar_outputs(target: str, dtype: str | None, prompts: dict[str, str], max_tokens: int,
               max_batch_size: int = 8, threads: int | None = None) -> dict[str, list[int]]:
    """Plain greedy decoding of each prompt by the target alone, in this process."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from ..core.sampling import SamplingParams
    from ..engine.request import Request
    from ..launch.engine_factory import make_engine, quiet_transformers
    from ..launch.loading import load_pair

    quiet_transformers()
    pair = load_pair(target, None, dtype=dtype, need_drafter=False)
    ids = {k: chat_prompt_ids(pair.tokenizer, text) for k, text in prompts.items()}
    longest = max(len(v) for v in ids.values()) + max_tokens + 1
    engine = make_engine(pair, "ar", max_batch_size, longest, 0, num_requests=len(ids))
    reqs = [Request(v, SamplingParams(temperature=0.0, max_new_tokens=max_tokens,
                                      stop_token_ids=pair.stop_token_ids), request_id=k)
            for k, v in ids.items()]
    return {out.request_id: list(out.output_ids) for out in engine.run(reqs)}
