"""The OPD loss, its forward-KL variant and the OSD baseline, over the drafter's blocks.

OPD (AdaFlash) mixes a hard and a soft term on the target's own responses. With the reference's
normalisation (``norm="weights"``, the default):

    N     = sum of w over the valid slots (of the whole batch, or of one sequence: ``scope``)
    CE    = sum_i w_i * CE(drafter_i, argmax target_i) / N
    kd_i  = KL(p_drafter^T || p_target^T)_i * T^2 / N          (teacher detached)
    soft  = sum_i w_i * min(kd_i, tau)                         (entry-wise clip)
    loss  = alpha * CE + (1 - alpha) * soft

w_k = exp(-(k-1)/gamma) for block slot k >= 1. Reverse KL is mode-seeking: the drafter is pushed
to put its mass where the target's is, which is what greedy verification rewards. The soft term
is normalised *before* it is clipped, entry by entry: an entry whose share exceeds tau contributes
the constant tau and no gradient, so a few slots the drafter cannot fit (a fork in the response
it has no way to predict) stop dominating the update instead of being merely scaled down. T^2
keeps the soft term's gradient the size it has at T = 1 when the temperature softens both
distributions (Hinton et al.); at T = 1 it is 1.

``norm="count"`` is this project's earlier choice: CE over the decayed-weight sum, the soft term
over the *number* of valid slots (about 2.2x the weight sum for blocks of 16, gamma 7), so the
soft term is smaller and its clip looser; ``t_squared=False`` drops the T^2 factor. Both are kept
as options so the choice is measured (benchmarks/opd/README.md, "Ablation"), not assumed.

The denominators are passed in per block row (``ce_norm``, ``kl_norm``: [N] or scalars) with the
number of normalisation groups (``groups``: 1 for a batch-normalised step, the sequence count
when every sequence is its own micro-batch, as in the reference), so data-parallel ranks can use
the global values and their summed gradients equal one process's on the whole batch.

The forward-KL variant (``--loss fkl``) keeps everything but the direction of the soft term:
KL(p_target || p_drafter) is mass-covering, so it also spends the drafter's capacity on the
target's low-probability tokens, which greedy verification never asks for.

OSD (the baseline, ``--loss sft``) is the plain position-weighted CE on the response tokens.

No function here moves data to the host: every result is a tensor on the logits' device, so a
training step synchronises with the GPU once, where it logs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training_job.block_losses import IGNORE

#: The reference's N is the decayed-weight sum plus this (an empty batch divides by it).
NORM_EPS = 1e-6
NORMS = ("weights", "count")


@dataclass
class LossParts:
    loss: torch.Tensor  # what backward() runs on (this rank's share)
    ce: torch.Tensor  # detached
    kl: torch.Tensor  # detached soft term, after clipping and weighting (0 for OSD)
    clipped: torch.Tensor  # detached count of entries whose share exceeded tau


def valid_slots(labels: torch.Tensor) -> torch.Tensor:
    """[N, B] bool: slots with a label (slot 0 and slots past the sequence never are)."""
    return labels != IGNORE


def denominators(labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid slot count, decayed-weight sum) of some blocks: float64 scalars on the labels'
    device, ready to all-reduce."""
    valid = valid_slots(labels)
    w = weights.to(device=labels.device, dtype=torch.float64)
    return valid.sum().to(torch.float64), (w[None, :] * valid).sum()


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


def _rows(norm, n: int, like: torch.Tensor) -> torch.Tensor:
    """A denominator as a [n, 1] column on ``like``'s device (a scalar is broadcast)."""
    t = torch.as_tensor(norm, device=like.device, dtype=torch.float32)
    return t.reshape(-1, 1).expand(n, 1) if t.numel() == 1 else t.reshape(n, 1)


def _weighted_ce(logits, targets, valid, weights, norm, groups):
    ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten().clamp(min=0),
                         reduction="none").view(targets.shape)
    w = weights[None, :] * valid
    return (ce * w / norm).sum() / groups


def opd_loss(drafter_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
             weights: torch.Tensor, *, alpha: float = 0.8, tau: float = 0.01,
             temperature: float = 1.0, divergence: str = "rkl", t_squared: bool = True,
             ce_norm=None, kl_norm=None, groups: float = 1.0) -> LossParts:
    """drafter/target logits [N, B, V] (target's at the position that predicts slot k), labels
    [N, B] (IGNORE where invalid), weights [B].

    ``ce_norm``/``kl_norm``: the denominators of the CE and soft terms, scalars or [N] per block
    (default: this batch's decayed-weight sum + 1e-6, the reference's N); ``groups``: how many
    normalisation groups the batch holds (the loss is their mean). ``divergence``: "rkl" (the
    default) or "fkl"; ``t_squared``: multiply the KL by T^2 (the reference does).
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {sorted(DIVERGENCES)}, got {divergence!r}")
    n = labels.shape[0]
    if ce_norm is None or kl_norm is None:
        wsum = denominators(labels, weights)[1] + NORM_EPS
        ce_norm = wsum if ce_norm is None else ce_norm
        kl_norm = wsum if kl_norm is None else kl_norm
    ce_rows, kl_rows = _rows(ce_norm, n, drafter_logits), _rows(kl_norm, n, drafter_logits)
    valid = valid_slots(labels)
    w = weights.to(drafter_logits.device).float()
    greedy = target_logits.argmax(-1)
    ce = _weighted_ce(drafter_logits, greedy, valid, w, ce_rows, groups)
    kl = DIVERGENCES[divergence](drafter_logits, target_logits.detach(), temperature)
    if t_squared:
        kl = kl * (temperature * temperature)
    share = kl / kl_rows
    over = (share > tau) & valid
    # torch.where sends no gradient to `share` where the constant is taken.
    clipped = torch.where(over, torch.full_like(share, tau), share)
    soft = (w[None, :] * clipped * valid).sum() / groups
    loss = alpha * ce + (1.0 - alpha) * soft
    return LossParts(loss, ce.detach(), soft.detach(), over.sum().detach())


def osd_loss(drafter_logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, *,
             ce_norm=None, groups: float = 1.0) -> LossParts:
    """Position-weighted CE on the response tokens (the OSD baseline)."""
    if ce_norm is None:
        ce_norm = denominators(labels, weights)[1] + NORM_EPS
    valid = valid_slots(labels)
    w = weights.to(drafter_logits.device).float()
    ce = _weighted_ce(drafter_logits, labels, valid, w,
                      _rows(ce_norm, labels.shape[0], drafter_logits), groups)
    zero = torch.zeros((), device=ce.device)
    return LossParts(ce, ce.detach(), zero, zero.long())
