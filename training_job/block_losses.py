"""The offline recipe's blocks and losses: anchors, the block layout, the weighting over
block positions, the losses, and the acceptance a block shows.

A block is an anchor token plus B-1 mask tokens at positions anchor..anchor+B-1; slot k
(k >= 1) is labelled with the token at anchor+k, weighted by exp(-(k-1)/gamma). Shared by the
offline recipe (dflash_offline), on-policy distillation (opd) and the recovery drafter's recipe.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100


def sample_anchors(prompt_len: int, seq_len: int, num: int, rng: random.Random) -> list[int]:
    """Distinct anchors among response positions that leave at least one label after them."""
    lo, hi = max(prompt_len, 1), seq_len - 2  # anchor + 1 <= seq_len - 1
    if hi < lo:
        return []
    cand = list(range(lo, hi + 1))
    return sorted(rng.sample(cand, min(num, len(cand))))


@dataclass
class Blocks:
    """Training blocks of one batch; N blocks, block size B, context length C (padded)."""

    # [N] which sequence of the batch each block belongs to
    seq_indices: torch.Tensor
    # [N, B] anchor token then mask tokens
    input_ids: torch.Tensor
    # [N, B] absolute positions anchor..anchor+B-1
    positions: torch.Tensor
    # [N, B] token at anchor+k for slot k >= 1; IGNORE for slot 0 and past the sequence
    labels: torch.Tensor
    # [N, 1, B, C+B] True = may attend: context keys < anchor, all keys of its own block
    mask: torch.Tensor


def make_blocks(ids: torch.Tensor, lens: list[int], anchors: list[list[int]], block_size: int,
                mask_token_id: int) -> Blocks:
    """ids [bs, C] (padded), lens [bs], anchors per sequence -> :class:`Blocks`."""
    c = ids.shape[1]
    seq_idx, inp, pos, lab, ctx_ok = [], [], [], [], []
    key_pos = torch.arange(c)
    ks = torch.arange(block_size)
    for i, (n, anchor_list) in enumerate(zip(lens, anchors)):
        for a in anchor_list:
            seq_idx.append(i)
            row = torch.full((block_size,), mask_token_id, dtype=torch.long)
            row[0] = ids[i, a]
            inp.append(row)
            pos.append(a + ks)
            tgt = torch.full((block_size,), IGNORE, dtype=torch.long)
            upto = min(block_size, n - a)
            tgt[1:upto] = ids[i, a + 1:a + upto]
            lab.append(tgt)
            ctx_ok.append(key_pos < a)
    n_blocks = len(seq_idx)
    ctx = torch.stack(ctx_ok) if n_blocks else torch.zeros(0, c, dtype=torch.bool)
    own = torch.ones(n_blocks, block_size, dtype=torch.bool)
    mask = torch.cat([ctx[:, None, :].expand(-1, block_size, -1),
                      own[:, None, :].expand(-1, block_size, -1)], dim=-1)[:, None]
    return Blocks(torch.tensor(seq_idx, dtype=torch.long), torch.stack(inp), torch.stack(pos),
                  torch.stack(lab), mask)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] slot weights: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def loss_slots(block_size: int, gamma: float, floor: float = 0.01) -> int:
    """Leading block slots (slot 0 included) whose weight exp(-(k-1)/gamma) is at least
    ``floor``: the drafter's last layer, the LM head and the loss run on these alone in training
    (every slot still gives keys and values, so their states are exactly the whole block's).
    Gamma 7 keeps all 16 slots of a block; gamma 2 keeps 11, and the 5 it drops weighed 1.4%
    of a block, for a third of the LM head's work."""
    w = position_weights(block_size, gamma)
    return max(2, min(block_size, int((w[1:] >= floor).sum()) + 1))


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """logits [N, B, V], labels [N, B], weights [B] -> weighted mean CE over valid slots."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp(min=0),
                         reduction="none").view(labels.shape)
    w = weights[None, :] * (labels != IGNORE)
    return (ce * w).sum() / w.sum().clamp(min=1e-8)


def distill_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
               weights: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Weighted mean over valid slots of KL(p_teacher || p_drafter) at ``temperature`` (times
    T^2, so the gradient's scale does not shrink with T).

    logits, teacher_logits [N, B, V] (slot k's teacher is the target's distribution at the
    position before slot k's label); labels [N, B] mark the valid slots; weights [B].
    The teacher is detached. At T=0 on regenerated data the hard label is the teacher's argmax,
    so this gives the drafter the rest of the target's distribution: which near misses are near.
    """
    t = float(temperature)
    log_q = F.log_softmax(logits.float() / t, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1) * (t * t)  # [N, B]
    w = weights[None, :] * (labels != IGNORE)
    return (kl * w).sum() / w.sum().clamp(min=1e-8)


def accept_lengths(proposals: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Leading proposals (slots 1..B-1) equal to the labels. [N, B] x2 -> [N] long."""
    ok = (proposals[:, 1:] == labels[:, 1:]) & (labels[:, 1:] != IGNORE)
    return ok.long().cumprod(dim=1).sum(dim=1)


# ---------------------------------------------------------------------------------------------
# The forward over one batch
