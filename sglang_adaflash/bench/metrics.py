"""Speculation statistics of one benchmark run, aggregated over its requests (pure functions).

Words as in sglang_adaflash.core.rejection: a decode step commits tau tokens (accepted proposals
plus one bonus or recovered token) after verifying L tokens (the verify length). The first token
of every request comes from prefill and is not a step.
"""

from __future__ import annotations

import math
from collections import defaultdict

from ..engine.request import RequestOutput


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation, or None when it is undefined (fewer than 2 points, a constant side)."""
    n = len(xs)
    if n < 2 or n != len(ys):
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 1e-24 or syy <= 1e-24:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy / math.sqrt(sxx * syy)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def length_head_stats(outputs: list[RequestOutput], block_size: int) -> dict | None:
    """Predicted ratio (E[tau]/B from the head) against the step's actual tau/B, pooled over steps.

    The actual tau is capped by the verify length the rule chose, so a head that is right but
    whose predictions shortened the verify window still shows some under-shoot.
    """
    pred, actual = [], []
    for out in outputs:
        s = out.stats
        pred.extend(s.predicted_ratios)
        actual.extend(a / block_size for a in s.accept_lens[: len(s.predicted_ratios)])
    if not pred:
        return None
    n = len(pred)
    return {
        "steps": n,
        "mean_predicted_ratio": sum(pred) / n,
        "mean_actual_ratio": sum(actual) / n,
        "mean_abs_error": sum(abs(p - a) for p, a in zip(pred, actual)) / n,
        "pearson": pearson(pred, actual),
    }


def aggregate(outputs: list[RequestOutput], block_size: int) -> dict:
    """tau, verify efficiency, accepted tokens by position, per-domain tau, length-head stats."""
    ok = [o for o in outputs if o.ok]
    steps = sum(o.stats.steps for o in ok)
    committed = sum(o.stats.committed_tokens for o in ok)
    verified = sum(o.stats.verified_tokens for o in ok)
    width = max(block_size - 1, 0)
    by_pos = [0] * width
    for o in ok:
        for k, c in enumerate(o.stats.accepted_by_position[:width]):
            by_pos[k] += c
    domains: dict[str, list[RequestOutput]] = defaultdict(list)
    for o in ok:
        if o.domain is not None:
            domains[o.domain].append(o)
    per_domain = {}
    for name, outs in sorted(domains.items()):
        d_steps = sum(o.stats.steps for o in outs)
        per_domain[name] = {
            "requests": len(outs),
            "steps": d_steps,
            "tau": _ratio(sum(o.stats.committed_tokens for o in outs), d_steps),
        }
    return {
        "requests": len(outputs),
        "failed": len(outputs) - len(ok),
        "generated_tokens": sum(len(o.output_ids) for o in ok),
        "steps": steps,
        "committed_tokens": committed,
        "verified_tokens": verified,
        "tau": _ratio(committed, steps),
        "verify_efficiency": _ratio(committed, verified),
        "mean_verify_len": _ratio(verified, steps),
        "accepted_by_position": by_pos,
        "acceptance_rate_by_position": [c / steps if steps else 0.0 for c in by_pos],
        "per_domain": per_domain,
        "length_head": length_head_stats(ok, block_size),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def step_mae_floor(ratio: float, length: int, block: int) -> float:
    """E|tau - E tau| / B for geometric acceptance with E[tau | L] = ratio * B.

    The error that even a perfectly calibrated prediction of one step's tau/B makes, because the
    step's tau is itself random: the floor under any per-step calibration error. The acceptance
    rate a is found by bisection (E[tau | L](a) = sum_{s < L} a^s grows with a); tau = k with
    probability a^(k-1) (1 - a) for k < L and a^(L-1) for k = L.
    """
    target = ratio * block
    lo, hi = 0.0, 1.0
    for _ in range(40):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**s for s in range(length)) < target else (lo, a)
    a = (lo + hi) / 2
    probs = [a ** (k - 1) * (1 - a) for k in range(1, length)] + [a ** (length - 1)]
    mu = sum(k * q for k, q in enumerate(probs, 1))
    return sum(abs(k - mu) * q for k, q in enumerate(probs, 1)) / block

