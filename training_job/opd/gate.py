"""The gate: does the candidate beat its parent on the round's held-out prompts, beyond noise?

Both drafters decode the same held-out prompts with the same target (greedy speculative decoding
is lossless, so they see identical contexts); each prompt gives (committed tokens, decode steps)
for each. tau of a domain is its tokens over its steps, the mean tau the unweighted mean over
domains, the gain ``mean tau / parent's mean tau - 1``.

A single reading of those numbers can fool a gate: on 64 prompts a domain's tau moves by several
hundredths between two slices of the same traffic, and a tie is not a gain. So the noise is
estimated with a paired bootstrap over prompts, stratified by domain: every resample draws each
domain's prompts with replacement and recomputes both drafters' tau on the *same* draw (pairing
removes what the prompts themselves contribute, which is most of the spread). The decision:

- mean: the gain's lower bound (the ``1 - confidence`` quantile of the resampled gains) must be
  above ``min_gain``: a candidate passes when it is better beyond the noise (a tie fails);
- floor: no domain may drop beyond its noise: a domain fails when the upper bound (the
  ``confidence`` quantile) of its resampled ``tau - parent tau`` is below 0. Domains with fewer
  than ``min_domain_prompts`` held-out prompts are reported but not floored (their bootstrap
  says little).

Everything is a function of the per-prompt numbers and the settings (the resamples are seeded),
so the decision is reproducible from the manifest's evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PASSED, NO_GAIN, DOMAIN_DROP, NO_EVALUATION = "Passed", "NoGain", "DomainDrop", "NoEvaluation"


@dataclass(frozen=True)
class GateConfig:
    min_gain: float = 0.0
    confidence: float = 0.95
    resamples: int = 1000
    min_domain_prompts: int = 4
    seed: int = 0
    refuse: bool = False  # --require-gain: a failed gate publishes nothing

    def __post_init__(self):
        problems = []
        if not (math.isfinite(self.min_gain) and self.min_gain > -1):
            problems.append(f"the gate's minimum gain must be a finite number > -1, "
                            f"got {self.min_gain}")
        if not (math.isfinite(self.confidence) and 0.5 <= self.confidence < 1):
            problems.append(f"--gate-confidence must lie in [0.5, 1), got {self.confidence}")
        if self.resamples < 100:
            problems.append(f"--gate-resamples must be >= 100, got {self.resamples}")
        if self.min_domain_prompts < 1:
            problems.append(f"--gate-min-domain-prompts must be >= 1, got "
                            f"{self.min_domain_prompts}")
        if problems:
            raise ValueError("; ".join(problems))


def _paired(cand: list, parent: list) -> dict[str, torch.Tensor]:
    """{domain: [n, 4] float64 (tokens, steps, parent tokens, parent steps)} over the prompts
    both drafters decoded. Rows are (key, domain, tokens, steps)."""
    base = {key: (tok, steps) for key, _, tok, steps in parent}
    out: dict[str, list] = {}
    for key, domain, tok, steps in cand:
        if key in base and steps and base[key][1]:
            out.setdefault(domain, []).append((tok, steps, *base[key]))
    return {d: torch.tensor(sorted(rows), dtype=torch.float64) for d, rows in sorted(out.items())}


def _r(x: float) -> float:
    return round(float(x), 4)


def decide(cand: list, parent: list, cfg: GateConfig) -> dict:
    """The gate's decision and its numbers (camelCase: this goes into the Job's report)."""
    paired = _paired(cand, parent)
    out = {"minGain": cfg.min_gain, "confidence": cfg.confidence, "resamples": cfg.resamples,
           "prompts": sum(len(x) for x in paired.values())}
    if not paired:
        return {**out, "passed": False, "reason": NO_EVALUATION,
                "message": "no held-out prompt was decoded by both drafters"}
    g = torch.Generator().manual_seed(cfg.seed * 7919 + 1)
    tau, ptau, draws, pdraws = {}, {}, [], []
    domains: dict[str, dict] = {}
    for d, x in paired.items():
        n = x.shape[0]
        tau[d], ptau[d] = x[:, 0].sum() / x[:, 1].sum(), x[:, 2].sum() / x[:, 3].sum()
        s = x[torch.randint(n, (cfg.resamples, n), generator=g)].sum(1)  # [R, 4]
        c, p = s[:, 0] / s[:, 1], s[:, 2] / s[:, 3]
        draws.append(c)
        pdraws.append(p)
        upper = torch.quantile(c - p, cfg.confidence)
        delta = tau[d] - ptau[d]
        floored = n >= cfg.min_domain_prompts
        domains[d] = {"prompts": n, "delta": _r(delta), "noise": _r(upper - delta),
                      "floored": floored, "dropped": bool(floored and upper < 0)}
    mean, pmean = sum(tau.values()) / len(tau), sum(ptau.values()) / len(ptau)
    gains = torch.stack(draws).mean(0) / torch.stack(pdraws).mean(0) - 1
    gain = float(mean / pmean - 1)
    low = float(torch.quantile(gains, 1 - cfg.confidence))
    dropped = [d for d, v in domains.items() if v["dropped"]]
    out.update(meanTau=_r(mean), parentMeanTau=_r(pmean), gain=_r(gain), gainLow=_r(low),
               domains=domains)
    conf = f"{cfg.confidence:.0%}"
    if dropped:
        why = "; ".join(f"{d} {domains[d]['delta']:+.3f} (noise {domains[d]['noise']:.3f})"
                        for d in dropped)
        return {**out, "passed": False, "reason": DOMAIN_DROP,
                "message": f"a domain dropped beyond its noise ({conf}): {why}"}
    verdict = f"gain {gain:+.1%}, lower bound {low:+.1%} at {conf}, required {cfg.min_gain:+.1%}"
    if not low > cfg.min_gain:
        return {**out, "passed": False, "reason": NO_GAIN,
                "message": f"mean tau {mean:.3f} against {pmean:.3f}: {verdict}"}
    return {**out, "passed": True, "reason": PASSED,
            "message": f"mean tau {mean:.3f} against {pmean:.3f}: {verdict}; no domain dropped "
                       "beyond its noise"}
