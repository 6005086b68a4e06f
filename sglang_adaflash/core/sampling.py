"""Sampling parameters and the filtered distributions both models are sampled from.

Top-k and top-p are applied the same way to the target's and the drafter's logits, so the
rejection sampler compares like with like and its output follows the target's *filtered*
distribution: exactly what plain sampling with those settings would produce.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

#: Temperatures below this decode greedily. softmax(logits / T) for T this small puts all its
#: mass on the argmax unless two logits lie within ~1e-4 of each other, and dividing float32
#: logits by a smaller T overflows (1e-38 gives inf, 1e-300 rounds to 0 and gives NaN). The same
#: epsilon as vLLM's; SGLang uses 1e-6.
SAMPLING_EPS = 1e-5
# The temperature a sampled row is divided by is clamped to [SAMPLING_EPS, _MAX_T]: a float64
# temperature past float32's range would become inf, and logits / inf is 0 or NaN.
_MAX_T = torch.finfo(torch.float32).max


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension: the first index of the largest value (or of the
    first NaN), as `argmax` gives it.

    On a CPU `max(-1).indices` returns the same indices (both keep the first of tied values)
    in less time: on the Intel Xeon measured, 12.5 us against 31 for a 5-token verify's logits
    over a 4096-token vocabulary, 10 against 25 for 4 proposals', 18 against 49 for a plain
    step at c=8 (benchmarks/host_ops/). A decode step takes one or two.
    Elsewhere `argmax` stays, whose tie rule is the documented one on every device.
    """
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


class RequestError(ValueError):
    """A request the engine refuses; it fails alone, the rest of the batch goes on."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below SAMPLING_EPS (0 included) = greedy
    top_k: int = 0  # 0 = no top-k
    top_p: float = 1.0  # 1 = no top-p
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # A seeded sampled request draws only from its own generator, so the same seed, prompt and
    # drafter give the same output whatever else shares the batch. None: the engine's generator.
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def canonical(self, vocab_size: int) -> SamplingParams:
        """The same decoding, spelt one way (what traffic records store): a temperature below
        SAMPLING_EPS is 0 (greedy), a top_k at or past the vocabulary is 0 (off)."""
        return dataclasses.replace(self, temperature=0.0 if self.greedy else self.temperature,
                                   top_k=0 if self.top_k >= vocab_size else self.top_k)

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
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        bad = [s for s in self.stop_token_ids if not 0 <= int(s) < vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


# Sorting the whole vocabulary for top-p is the sampled step's largest cost on a CPU (a
# [rows, V] sort per drafter and per target call). When the nucleus lies inside the
# PARTIAL_TOP best tokens, a top-k of that size gives the very same set for a fraction of it.
PARTIAL_TOP = 256


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k and top-p set, renormalised.

    logits [N, V]; temperature, top_k, top_p [N] (rows must have T > 0). Returns float32 [N, V].
    Finite logits give a distribution for every T > 0 and top_p > 0: T is clamped to
    [SAMPLING_EPS, float32 max] (callers decode rows below SAMPLING_EPS greedily), and the
    top-p set always keeps the most likely token, however small top_p rounds in float32.
    """
    logits = logits.float() / temperature.float().clamp(SAMPLING_EPS, _MAX_T)[:, None]
    vocab = logits.shape[-1]
    if not bool(((top_k > 0) & (top_k < vocab)).any()) and not bool((top_p < 1).any()):
        return logits.softmax(-1)  # nothing to filter
    window = min(vocab, max(PARTIAL_TOP, int(top_k.max())))
    if window < vocab:
        out = _filtered_in_window(logits, top_k, top_p, window)
        if out is not None:
            return out
    return _filtered_sorted(logits, top_k, top_p)


def _keep_mask(sorted_logits: torch.Tensor, probs_sorted_fn, top_k: torch.Tensor,
               top_p: torch.Tensor) -> torch.Tensor:
    """Which of the descending-sorted entries survive top-k then top-p (at least the first)."""
    width = sorted_logits.shape[-1]
    rank = torch.arange(width, device=sorted_logits.device)[None]
    k = torch.where(top_k > 0, top_k, width)[:, None]
    drop = rank >= k
    probs_sorted = probs_sorted_fn(sorted_logits.masked_fill(drop, float("-inf")))
    # drop a token once the mass strictly before it already reaches top_p; the first is always
    # kept (a top_p of 1e-300 is 0 in float32, and 0 >= 0 would drop every token)
    mass_before = probs_sorted.cumsum(-1) - probs_sorted
    return ~(drop | (mass_before >= top_p.float()[:, None])) | (rank == 0)


def _filtered_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    keep = _keep_mask(sorted_logits, lambda x: x.softmax(-1), top_k, top_p)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(-1)


def _filtered_in_window(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        window: int) -> torch.Tensor | None:
    """The same filter over the `window` best tokens; None when some row's set may reach past it.

    A row with 0 < top_k <= window keeps a subset of the window by definition. A row without
    top-k keeps a token only while the (full-vocabulary) mass before it is below top_p, so when
    the window's own mass reaches top_p nothing past the window can survive. Rows with no
    filter at all (a batch mixes requests) get their plain softmax.
    """
    top_vals, top_idx = logits.topk(window, dim=-1)  # sorted, descending
    lse = logits.logsumexp(-1, keepdim=True)
    restricted = top_k > 0
    unfiltered = ~restricted & (top_p >= 1)
    covered = restricted | unfiltered | ((top_vals - lse).exp().sum(-1) >= top_p.float())
    if not bool(covered.all()):
        return None

    def probs_sorted(masked: torch.Tensor) -> torch.Tensor:
        # top-k rows renormalise over their k best; the others keep full-vocabulary probabilities
        return torch.where(restricted[:, None], masked.softmax(-1), (masked - lse).exp())

    keep = _keep_mask(top_vals, probs_sorted, top_k, top_p)
    kept = top_vals.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, top_idx, kept)
    filtered = torch.where(unfiltered[:, None], logits, filtered)
    return filtered.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row. probs [N, V] -> ids [N]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
