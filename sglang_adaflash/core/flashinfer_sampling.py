"""FlashInfer's fused sampling kernels on CUDA, with the torch path as the fallback.

Used where they fit: plain sampling from filtered probabilities, and chain speculative sampling
when every sampled row checks the same number of candidates (FlashInfer's kernel has no ragged
candidate lengths; ragged rows take the torch verifier). FlashInfer has no CPU kernels, so on this
project's CPU machines everything runs in torch; tests marked `gpu` check that both agree.
"""

from __future__ import annotations

import functools

import torch

from .verify_result import VerifyResult


@functools.cache
def _flashinfer_sampling():
    try:
        from flashinfer import sampling  # type: ignore[import-not-found]
    except Exception:  # not installed, or built without kernels for this device
        return None
    return sampling


def available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and _flashinfer_sampling() is not None


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of probs [N, V] (already filtered and normalised)."""
    fi = _flashinfer_sampling()
    return fi.sampling_from_probs(probs.float().contiguous(), generator=generator).long()


def verify_sampling_uniform(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_candidates: int,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Chain speculative sampling when all rows check `num_candidates` proposals.

    draft_ids [bs, K]; draft_probs [bs, K, V]; target_probs [bs, K+1, V]. Returns the same
    VerifyResult layout as the torch verifier (committed tokens padded with PLACEHOLDER = -1).
    """
    fi = _flashinfer_sampling()
    k = num_candidates
    out = fi.chain_speculative_sampling(
        draft_probs[:, :k].float().contiguous(),
        draft_ids[:, :k].int().contiguous(),
        target_probs[:, : k + 1].float().contiguous(),
        generator=generator,
    ).long()  # [bs, k+1], -1 past the committed tokens
    num_accepted = (out >= 0).sum(dim=1) - 1
    width = draft_ids.shape[1] + 1
    tokens = torch.full((out.shape[0], width), -1, dtype=torch.long, device=out.device)
    tokens[:, : k + 1] = out
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)
