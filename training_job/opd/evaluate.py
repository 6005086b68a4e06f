"""The evaluation the operator's gate reads: held-out tau per domain, candidate against parent.

tau is measured the way serving measures it, through the reference engine
(:class:`sglang_adaflash.engine.engine.SpecEngine`): the held-out prompts are decoded greedily
with the whole block verified (mode ``dflash``), and tau per domain is committed tokens over
decode steps (accepted proposals plus the bonus token, as `adaflash.io/acceptance-tau`). The
candidate and the parent decode the same prompts with the same target, and greedy speculative
decoding is lossless, so both see identical contexts: the difference is the drafter alone.
Mode ``dflash`` rather than ``adaflash`` keeps the length head's truncation, which depends on
load, out of the drafter's score.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .traffic import Sample


@torch.no_grad()
def engine_results(target_model, drafter, samples: list[Sample], *, max_new_tokens: int = 64,
                   max_prompt_len: int = 960, batch_size: int = 16, stop_ids=(),
                   seed: int = 0) -> list[list]:
    """[key, domain, committed tokens, decode steps] of ``drafter`` on each sample's prompt,
    sorted by key: the per-prompt numbers the gate resamples.

    Each prompt decodes as many tokens as its served response had, at most ``max_new_tokens``.
    """
    from sglang_adaflash.core.sampling import SamplingParams
    from sglang_adaflash.engine.engine import SpecEngine
    from sglang_adaflash.engine.request import Request
    from sglang_adaflash.target.hf_target import HFTarget

    if not samples:
        return []
    target = HFTarget(target_model)
    was_training = drafter.training
    drafter.eval()
    requests = []
    for s in samples:
        prompt = s.prompt_ids[-max_prompt_len:]
        n = max(1, min(max_new_tokens, len(s.output_ids)))
        requests.append(Request(prompt_ids=list(prompt), request_id=s.key, domain=s.domain,
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=n,
                                                        stop_token_ids=tuple(stop_ids))))
    longest = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    engine = SpecEngine(target, drafter, mode="dflash", max_batch_size=batch_size,
                        max_seq_len=longest + 1, seed=seed)
    rows = []
    for out in engine.run(requests):
        if not out.ok:
            raise RuntimeError(f"evaluation request {out.request_id} failed: {out.error}")
        rows.append([out.request_id, out.domain, out.stats.committed_tokens, out.stats.steps])
    drafter.train(was_training)
    return sorted(rows)


def summarise(rows: list[list]) -> dict[str, dict]:
    """{domain: {"tau", "steps", "tokens", "requests"}} of :func:`engine_results` rows."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for _, domain, tokens, steps in rows:
        t = totals[domain]
        t[0] += tokens
        t[1] += steps
        t[2] += 1
    return {d: {"tau": tokens / steps if steps else 0.0, "steps": steps, "tokens": tokens,
                "requests": n} for d, (tokens, steps, n) in sorted(totals.items())}


def engine_tau(target_model, drafter, samples: list[Sample], **kw) -> dict[str, dict]:
    """{domain: {"tau", "steps", "tokens", "requests"}} of ``drafter`` on ``samples``' prompts."""
    return summarise(engine_results(target_model, drafter, samples, **kw))


def taus(result: dict[str, dict]) -> dict[str, float]:
    return {d: round(v["tau"], 4) for d, v in result.items() if v["steps"]}


def tau_by_domain(rows: list[list]) -> dict[str, float]:
    return taus(summarise(rows))


def mean_tau(t: dict[str, float]) -> float | None:
    return sum(t.values()) / len(t) if t else None
