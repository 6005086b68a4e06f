"""Sampling parameters and the filtered distributions both models are sampled from.

Top-k and top-p are applied the same way to the target's and the drafter's logits, so the
rejection sampler compares like with like and its output follows the target's *filtered*
distribution: exactly what plain sampling with those settings would produce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class RequestError(ValueError):
    """A request the engine refuses; it fails alone, the rest of the batch goes on."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k
    top_p: float = 1.0  # 1 = no top-p
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        bad = [s for s in self.stop_token_ids if not 0 <= int(s) < vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k and top-p set, renormalised.

    logits [N, V]; temperature, top_k, top_p [N] (rows must have T > 0). Returns float32 [N, V].
    """
    logits = logits.float() / temperature.float()[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = rank >= k
    probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # drop a token once the mass strictly before it already reaches top_p (keeps at least one)
    mass_before = probs_sorted.cumsum(-1) - probs_sorted
    drop |= mass_before >= top_p.float()[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row. probs [N, V] -> ids [N]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
