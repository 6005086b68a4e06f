"""Lossless verification of draft blocks: greedy matching and speculative (rejection) sampling.

Vocabulary (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023), used the same way everywhere in this project:

- proposal k (k = 1..K): the drafter's token for block slot k; K = candidates checked this step.
- accepted: a proposal the target agrees with (greedy: equals the target's argmax at slot k-1;
  sampling: kept with probability min(1, p(x) / q(x))). Acceptance stops at the first rejection.
- rejected: the first proposal not accepted; everything after it is discarded.
- recovered: the token sampled from the residual norm(max(0, p - q)) at the rejected slot.
- bonus: when all K proposals are accepted, one more token from the target at slot K.
- committed: the accepted proposals plus the bonus or recovered token (always at least one).
- tau (acceptance length): committed tokens per step = accepted + 1.

p is the target's (filtered) distribution at the slot before a proposal, q the drafter's
distribution that the proposal was sampled from. The verifier does not know how drafts were made:
it sees only draft ids, draft probabilities when sampling, and the target's logits.
"""

from __future__ import annotations

import torch

from . import flashinfer_sampling
from .sampling import filtered_probs, greedy_ids, sample_from
from .spec_metadata import SpecMetadata
from .verify_result import PLACEHOLDER, VerifyResult

__all__ = ["PLACEHOLDER", "RejectionSampler", "VerifyResult", "verify_greedy", "verify_sampling"]


def _first_rejection(accept: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """accept [bs, K] bool -> accepted prefix length [bs], never past num_candidates."""
    k = accept.shape[1]
    in_range = torch.arange(k, device=accept.device)[None] < num_candidates[:, None]
    return (accept & in_range).long().cumprod(dim=1).sum(dim=1)


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> VerifyResult:
    bs, k = draft_ids.shape
    slots = torch.arange(k + 1, device=draft_ids.device)[None]
    tokens = torch.full((bs, k + 1), PLACEHOLDER, dtype=torch.long, device=draft_ids.device)
    tokens[:, :k] = torch.where(slots[:, :k] < num_accepted[:, None], draft_ids, PLACEHOLDER)
    tokens.scatter_(1, num_accepted[:, None], last[:, None])
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)


def verify_greedy(
    draft_ids: torch.Tensor, target_logits: torch.Tensor, num_candidates: torch.Tensor
) -> VerifyResult:
    """draft_ids [bs, K]; target_logits [bs, K+1, V] (slot j predicts slot j+1); num_candidates [bs]."""
    target_ids = greedy_ids(target_logits)  # [bs, K+1]
    accepted = _first_rejection(draft_ids == target_ids[:, :-1], num_candidates)
    bonus = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return _assemble(draft_ids, accepted, bonus)


def verify_sampling(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_candidates: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Speculative sampling: the committed tokens follow the target's distribution exactly.

    draft_ids [bs, K] sampled from draft_probs q [bs, K, V]; target_probs p [bs, K+1, V].
    """
    bs, k = draft_ids.shape
    p_at = target_probs[:, :k].gather(2, draft_ids[..., None]).squeeze(-1)  # p(x_k) [bs, K]
    q_at = draft_probs.gather(2, draft_ids[..., None]).squeeze(-1)  # q(x_k) [bs, K]
    u = torch.rand(bs, k, generator=generator, device=draft_ids.device)
    accepted = _first_rejection(u * q_at < p_at, num_candidates)  # u < p/q without dividing
    rejected = accepted < num_candidates  # [bs]
    p_last = target_probs.gather(1, accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    q_idx = accepted.clamp(max=max(k - 1, 0))
    if k > 0:
        q_last = draft_probs.gather(1, q_idx[:, None, None].expand(-1, 1, draft_probs.shape[-1])).squeeze(1)
        residual = torch.where(rejected[:, None], (p_last - q_last).clamp(min=0), p_last)
    else:
        residual = p_last
    # p == q on the support makes a rejection impossible; guard the degenerate empty residual
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_last, residual)
    last = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)
    return _assemble(draft_ids, accepted, last)


class RejectionSampler:
    """Verifies a mixed batch in one call: greedy rows by matching the target's argmax, sampled
    rows by speculative sampling against their own filtered target distribution.

    It owns the shared random stream (a seeded request brings its own, see ``RowSampling``), and
    picks FlashInfer's fused kernel on CUDA where it applies: unseeded rows that all check the
    same number of proposals.
    """

    def __init__(self, generator: torch.Generator | None, use_flashinfer: bool = False):
        self.generator = generator
        self.use_flashinfer = use_flashinfer

    def verify(self, meta: SpecMetadata, target_logits: torch.Tensor) -> VerifyResult:
        """target_logits [bs, K'+1, V] with K' <= K: slot j predicts slot j + 1; rows verify at
        most K' proposals (the target ran on each row's verify length, padded)."""
        k = target_logits.shape[1] - 1
        draft_ids = meta.draft_ids[:, :k]
        num_candidates = (meta.lengths - 1).clamp(max=k).to(target_logits.device)
        result = verify_greedy(draft_ids, target_logits, num_candidates)
        hot = meta.sampled or []
        if not hot:
            return result
        rs = meta.sampling
        p = filtered_probs(target_logits[hot].flatten(0, 1), *rs.repeated(k + 1))
        p = p.view(len(hot), k + 1, -1)
        q = meta.draft_probs[:, :k] if meta.draft_probs is not None and k > 0 else \
            p.new_zeros(len(hot), 0, p.shape[-1])
        sampled = self._verify_sampled(draft_ids[hot], q, p, num_candidates[hot], rs.generators)
        result.tokens[hot] = sampled.tokens
        result.num_accepted[hot] = sampled.num_accepted
        return result

    def sample(self, probs: torch.Tensor,
               generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
        """One draw per row of probs [N, V]; generators[j] is row j's own stream, if any."""
        if generators is not None and any(g is not None for g in generators):
            return torch.cat([sample_from(probs[j:j + 1], g if g is not None else self.generator)
                              for j, g in enumerate(generators)])
        if self.use_flashinfer:
            return flashinfer_sampling.sample(probs, self.generator)
        return sample_from(probs, self.generator)

    def _verify_sampled(self, draft_ids, q, p, num_candidates, generators) -> VerifyResult:
        if generators is not None and any(g is not None for g in generators):
            # Seeded rows verify one at a time, each from its own stream and over its own
            # candidates only, so what a row draws does not depend on the batch around it.
            k = draft_ids.shape[1]
            tokens = torch.full((len(generators), k + 1), PLACEHOLDER, dtype=torch.long,
                                device=draft_ids.device)
            accepted = torch.zeros(len(generators), dtype=torch.long, device=draft_ids.device)
            for i, (g, n) in enumerate(zip(generators, num_candidates.tolist())):
                r = verify_sampling(draft_ids[i:i + 1, :n], q[i:i + 1, :n], p[i:i + 1, :n + 1],
                                    num_candidates[i:i + 1], g if g is not None else self.generator)
                tokens[i, :n + 1] = r.tokens[0]
                accepted[i] = r.num_accepted[0]
            return VerifyResult(tokens=tokens, num_accepted=accepted)
        n = num_candidates[0]
        if self.use_flashinfer and q.shape[1] > 0 and bool((num_candidates == n).all()):
            return flashinfer_sampling.verify_sampling_uniform(draft_ids, q, p, int(n), self.generator)
        return verify_sampling(draft_ids, q, p, num_candidates, self.generator)
