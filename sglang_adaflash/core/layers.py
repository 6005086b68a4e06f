"""Small building blocks shared by the drafter and the target runner: RMSNorm, RoPE, attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), normalised in float32 for half types (as the HF Qwen3/Llama norms)."""
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) RoPE tables. positions [...] -> cos, sin [..., head_dim]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    )
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Llama/Qwen convention). x [..., hd]; cos/sin broadcastable."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """Masked multi-head attention with grouped KV heads.

    q [N, nh, Q, hd], k/v [N, kvh, S, hd], mask [N, 1, Q, S] bool (True = may attend) or None.
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
