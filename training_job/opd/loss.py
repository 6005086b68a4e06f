"""The OPD loss, its forward-KL variant and the OSD baseline, over the drafter's blocks.

OPD (AdaFlash) mixes a hard and a soft term on the target's own responses:

    loss = alpha * CE(drafter, target argmax) + (1 - alpha) * sum_k w_k * min(RKL_k / N, tau)

RKL_k = KL(p_drafter || p_target) at block slot k, N the number of valid slots of the whole
(global) batch, w_k = exp(-(k-1)/gamma). Reverse KL is mode-seeking: the drafter is pushed to put
its mass where the target's is, which is what greedy verification rewards. The soft term is
normalised *before* it is clipped, entry by entry: an entry whose share exceeds tau contributes
the constant tau and no gradient, so a few slots the drafter cannot fit (a fork in the response
it has no way to predict) stop dominating the update instead of being merely scaled down.

Both denominators (N and the CE weight sum) are passed in, so data-parallel ranks can use the
global batch's values and their summed gradients equal one process's on the whole batch.

The forward-KL variant (``--loss fkl``) keeps everything but the direction of the soft term:
KL(p_target || p_drafter) is mass-covering, so it also spends the drafter's capacity on the
target's low-probability tokens, which greedy verification never asks for. It is there so the
choice of reverse KL can be measured rather than assumed.

OSD (the baseline, ``--loss sft``) is the plain position-weighted CE on the response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training_job.dflash_offline import IGNORE


@dataclass
class LossParts:
    loss: torch.Tensor  # what backward() runs on (this rank's share)
    ce: torch.Tensor  # detached
    kl: torch.Tensor  # detached soft term, after clipping and weighting (0 for OSD)
    clipped: int  # entries whose share exceeded tau


def valid_slots(labels: torch.Tensor) -> torch.Tensor:
    """[N, B] bool: slots with a label (slot 0 and slots past the sequence never are)."""
    return labels != IGNORE


def denominators(labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid slot count, CE weight sum) of one rank's blocks, float64 scalars to all-reduce."""
    valid = valid_slots(labels)
    return (valid.sum().to(torch.float64),
            (weights[None, :].to(torch.float64) * valid).sum())


def reverse_kl(drafter_logits: torch.Tensor, target_logits: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """KL(p_drafter || p_target) per slot: [N, B, V] x2 -> [N, B] (float32)."""
    log_pd = F.log_softmax(drafter_logits.float() / temperature, dim=-1)
    log_pt = F.log_softmax(target_logits.float() / temperature, dim=-1)
    return (log_pd.exp() * (log_pd - log_pt)).sum(-1)


def forward_kl(drafter_logits: torch.Tensor, target_logits: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """KL(p_target || p_drafter) per slot: [N, B, V] x2 -> [N, B] (float32)."""
    return reverse_kl(target_logits, drafter_logits, temperature)


DIVERGENCES = {"rkl": reverse_kl, "fkl": forward_kl}


def _weighted_ce(drafter_logits, targets, valid, weights, weight_sum):
    ce = F.cross_entropy(drafter_logits.flatten(0, 1).float(), targets.flatten().clamp(min=0),
                         reduction="none").view(targets.shape)
    w = weights[None, :] * valid
    return (ce * w).sum() / weight_sum.clamp(min=1e-8)


def opd_loss(drafter_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
             weights: torch.Tensor, *, alpha: float = 0.8, tau: float = 0.01,
             temperature: float = 1.0, count: torch.Tensor | None = None,
             weight_sum: torch.Tensor | None = None, divergence: str = "rkl") -> LossParts:
    """drafter/target logits [N, B, V] (target's at the position that predicts slot k), labels
    [N, B] (IGNORE where invalid), weights [B]. ``count``/``weight_sum``: global denominators
    (default: this batch's). ``divergence``: "rkl" (the default) or "fkl"."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {sorted(DIVERGENCES)}, got {divergence!r}")
    local_count, local_wsum = denominators(labels, weights)
    count = local_count if count is None else count
    weight_sum = local_wsum if weight_sum is None else weight_sum
    valid = valid_slots(labels)
    w = weights.to(drafter_logits.device).float()
    greedy = target_logits.argmax(-1)
    ce = _weighted_ce(drafter_logits, greedy, valid, w, weight_sum.float())
    kl_fn = DIVERGENCES[divergence]
    share = kl_fn(drafter_logits, target_logits, temperature) / count.float().clamp(min=1.0)
    over = (share > tau) & valid
    # torch.where sends no gradient to `share` where the constant is taken.
    clipped = torch.where(over, torch.full_like(share, tau), share)
    soft = (w[None, :] * clipped * valid).sum()
    loss = alpha * ce + (1.0 - alpha) * soft
    return LossParts(loss, ce.detach(), soft.detach(), int(over.sum()))


def osd_loss(drafter_logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, *,
             weight_sum: torch.Tensor | None = None) -> LossParts:
    """Position-weighted CE on the response tokens (the OSD baseline)."""
    if weight_sum is None:
        weight_sum = denominators(labels, weights)[1]
    valid = valid_slots(labels)
    w = weights.to(drafter_logits.device).float()
    ce = _weighted_ce(drafter_logits, labels, valid, w, weight_sum.float())
    zero = torch.zeros((), device=ce.device)
    return LossParts(ce, ce.detach(), zero, 0)
