"""AdaFlash's adaptive length head: how much of a draft block is worth verifying.

The head reads the drafter's final normed block states and predicts ratio = E[tau] / B, where tau
is the acceptance length (accepted proposals plus the bonus token). Verifying slots beyond the
likely first rejection wastes target compute, which is what matters once the batch is large.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AdaptiveLengthHead(nn.Module):
    """ratio = sigmoid(out(h + SiLU(res(h)))), h = SiLU(down([mean_k x_k ; x_last])).

    Module and parameter names (`down`, `res.0`, `out`) match the published AdaFlash checkpoints,
    where they sit under the prefix `thresh_head_two_model.`.
    """

    def __init__(self, hidden_size: int, bottleneck_dim: int = 256):
        super().__init__()
        self.down = nn.Linear(2 * hidden_size, bottleneck_dim)
        self.res = nn.Sequential(nn.Linear(bottleneck_dim, bottleneck_dim), nn.SiLU())
        self.out = nn.Linear(bottleneck_dim, 1)

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        # block_hidden: [bs, B, H] -> ratio [bs]
        return torch.sigmoid(self.logit(block_hidden)).float()

    def logit(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """The pre-sigmoid score [bs]: what a recalibration rescales (see `recalibrate`)."""
        x = block_hidden.to(self.down.weight.dtype)
        feat = torch.cat([x.mean(dim=1), x[:, -1]], dim=-1)  # [bs, 2H]
        h = F.silu(self.down(feat))
        h = h + self.res(h)
        return self.out(h).squeeze(-1)

    @torch.no_grad()
    def recalibrate(self, scale: float, shift: float) -> None:
        """ratio <- sigmoid(scale * logit + shift), folded into `out`: the checkpoint keeps its
        layout, so a recalibrated head loads (and hot-reloads) wherever the old one did."""
        self.out.weight.mul_(scale)
        self.out.bias.mul_(scale).add_(shift)


def candidate_lengths(
    ratio: torch.Tensor, block_size: int, rate: float = 1.3, min_len: int = 2
) -> torch.Tensor:
    """The paper's rule: clamp(round(ratio * B * rate), min_len, B). ratio [bs] -> [bs] long."""
    raw = torch.round(ratio.float() * block_size * rate).long()
    return raw.clamp(min=min_len, max=block_size)


def length_label(accept_len: torch.Tensor, block_size: int) -> torch.Tensor:
    """Training label: clamp(accept_len + 1, 0, B) / B, i.e. tau / B."""
    return (accept_len + 1).clamp(0, block_size).float() / block_size
