"""The DFlash block-diffusion drafter (architecture and weight names of the published checkpoints).

The drafter owns no embedding and no LM head: it borrows the target's. It is a stack of Qwen3-style
layers whose queries come from one block (slot 0 = last committed token, the rest mask tokens) and
whose keys/values are the same projections applied to [context features ; block]. Context features
are the target's hidden states at `target_layer_ids`, concatenated and projected by `fc`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core.layers import RMSNorm, apply_rope, attention, rope_cos_sin
from .config import DrafterConfig
from .length_head import AdaptiveLengthHead

LENGTH_HEAD_PREFIX = "thresh_head_two_model."


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        nh, kvh, hd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kvh, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, kvh * hd, bias=False)
        self.v_proj = nn.Linear(h, kvh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, S, H] -> k, v [N, kvh, S, hd] (k normed and rotated)."""
        n, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, s, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, s, self.num_kv_heads, self.head_dim)
        k = apply_rope(k, cos[:, :, None], sin[:, :, None])
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, rows=None):
        """x [N, Q, H] block states; ctx_k/v [N, kvh, C, hd]; mask [N, 1, Q, C+Q] or None (all
        visible) -> [N, Q, H].

        rows [N, R]: queries at those block slots only (every slot still gives keys and values)
        -> [N, R, H]; a slice reads the same slots of every row, by views."""
        bk, bv = self.key_value(x, cos, sin)
        if rows is not None:
            x, cos, sin = (_take_rows(t, rows) for t in (x, cos, sin))
            if mask is not None:
                mask = mask[:, :, rows] if isinstance(rows, slice) else \
                    mask.gather(2, rows[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[3]))
        n, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, self.head_dim))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None]).transpose(1, 2)
        k = torch.cat([ctx_k, bk], dim=2)
        v = torch.cat([ctx_v, bv], dim=2)
        out = attention(q, k, v, mask).transpose(1, 2).reshape(n, q_len, -1)
        return self.o_proj(out)


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, rows=None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask, rows)
        x = (x if rows is None else _take_rows(x, rows)) + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def _take_rows(t: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """t [N, Q, ...] -> [N, R, ...] at block slots rows [N, R], or a view at a slice of them."""
    if isinstance(rows, slice):
        return t[:, rows]
    return t.gather(1, rows.view(*rows.shape, *([1] * (t.dim() - 2))).expand(*rows.shape, *t.shape[2:]))


class DFlashDrafter(nn.Module):
    """Parameters: fc, hidden_norm, layers.N.*, norm, and optionally thresh_head_two_model.*."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        # the version's manifest.json when it was loaded from a published directory
        # (checkpoint.load_drafter, a hot reload): its eval seeds the calibration (planner.prior)
        self.manifest: dict | None = None
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.thresh_head_two_model = (
            AdaptiveLengthHead(h, cfg.length_head_bottleneck_dim) if cfg.use_length_head else None
        )
        # Borrowed from the target; plain attributes so they stay out of state_dict().
        self._shared: dict[str, nn.Module] = {}

    # -- the target's embedding and LM head -------------------------------------------------
    def share_target_modules(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self._shared = {"embed_tokens": embed_tokens, "lm_head": lm_head}

    @property
    def embed_tokens(self) -> nn.Module:
        if "embed_tokens" not in self._shared:
            raise RuntimeError("drafter has no embedding: call share_target_modules(target) first")
        return self._shared["embed_tokens"]

    @property
    def lm_head(self) -> nn.Module:
        if "lm_head" not in self._shared:
            raise RuntimeError("drafter has no LM head: call share_target_modules(target) first")
        return self._shared["lm_head"]

    @property
    def length_head(self) -> AdaptiveLengthHead | None:
        return self.thresh_head_two_model

    def ensure_length_head(self) -> AdaptiveLengthHead:
        """Adds a freshly initialised length head (for training one onto a plain DFlash drafter)."""
        if self.thresh_head_two_model is None:
            ref = self.fc.weight
            self.thresh_head_two_model = AdaptiveLengthHead(
                self.config.hidden_size, self.config.length_head_bottleneck_dim
            ).to(device=ref.device, dtype=ref.dtype)
            self.config = self.config.replace(use_length_head=True)
        return self.thresh_head_two_model

    # -- building blocks --------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Target hidden states [..., K*H] -> context features [..., H]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor, rope=None):
        """Per-layer K/V of context features. ctx [N, C, H], positions [N, C] -> [(k, v)] * layers.
        rope: RoPE's (cos, sin) at those positions when the caller has them (a decode-time
        table, engine.proposer), else computed."""
        cos, sin = rope if rope is not None else self.rope(positions, ctx.dtype)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None,
        read: torch.Tensor | slice | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Runs the layers over a block.

        block_embeds [N, Q, H]; block_positions [N, Q]; ctx_kv per layer ([N, kvh, C, hd] x2);
        mask [N, 1, Q, C+Q] bool, or None where every query sees every key (one request's block
        over its whole context). Returns the final normed block states [N, Q, H], or with read
        [N, R] (block slots; a slice when every row reads the same ones) only those states
        [N, R, H]: the last layer then runs its queries, output projection and MLP on those
        slots alone, since no later layer needs the others (a recovery branch reads 4 of a
        block's 16 slots). rope: (cos, sin) at block_positions when the caller has them, as in
        context_kv.
        """
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = rope if rope is not None else self.rope(block_positions, x.dtype)
        last = len(self.layers) - 1
        for i, (layer, (ck, cv)) in enumerate(zip(self.layers, ctx_kv)):
            x = layer(x, cos, sin, ck, cv, mask, read if i == last else None)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))
