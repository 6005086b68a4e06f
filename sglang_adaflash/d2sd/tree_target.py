"""One target forward over a batch of draft trees, and the commit of each accepted path's K/V.

The masked torch path: every tree node attends to its request's committed context and to its
own ancestors only (plus itself), at RoPE position cache_len + depth. Node K/V are kept aside
rather than written into the slot cache, because siblings share a position; after acceptance
only the accepted path's K/V are written, at consecutive positions, so the cache afterwards is
exactly what a chain verify of that path would have left. The attention is one padded call
over [context ; nodes] per layer, or, with a cascade (cascade.py: FlashInfer's kernels on CUDA),
the context and the nodes attended separately and merged, so the long context level needs no
per-node mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.kv_cache import SlotKVCache
from ..core.layers import apply_rope, attention
from ..target.hf_target import HFTarget, _norm
from .tree import FlatTree


@dataclass
class TreeForward:
    """The verify forward's states; logits are computed from `hidden` on demand.

    The LM head is the largest matmul of a small target's forward (about a sixth of this
    pair's per-token compute), and a greedy walk reads the logits of few nodes: the chain's and
    those of the branches at the one node where the chain stops (tree_verify.greedy_reads). Callers
    take the rows they need with logits_at; `logits` gives every node's.
    """

    hidden: torch.Tensor  # [bs, N, H] final normed states: node i's predicts the token after node i
    aux: torch.Tensor | None  # [bs, N, K*H] captured hidden states for the drafters' context
    node_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [bs, kvh, N, hd] x2 (RoPE'd)
    lm_head: nn.Module

    @property
    def logits(self) -> torch.Tensor:
        """[bs, N, V] at every node (padding included)."""
        with torch.inference_mode():
            return self.lm_head(self.hidden)

    def logits_at(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """[k, V] at nodes[j] of row rows[j]."""
        with torch.inference_mode():
            return self.lm_head(self.hidden[rows, nodes])


@torch.inference_mode()
def tree_forward(target: HFTarget, cache: SlotKVCache, tree: FlatTree, starts: torch.Tensor,
                 cascade=None) -> TreeForward:
    """starts [bs] committed cache lengths (rows are cache slots 0..bs-1). cascade: None for the
    one masked attention call per layer, or a cascade.TorchCascade / FlashInferCascade, which
    attends to the context and to the nodes separately and merges the two."""
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    hd = target.head_dim
    positions = starts[:, None] + tree.depths  # [bs, N]
    x = target.embed_tokens(tree.tokens.reshape(-1))  # [bs*N, H]
    cos, sin = target.backbone.rotary_emb(x[None], positions.reshape(1, -1))
    cos, sin = cos[0].view(bs, n, 1, hd), sin[0].view(bs, n, 1, hd)
    c = int(starts.max())
    mask = None
    if cascade is None:
        ctx_ok = torch.arange(c, device=dev)[None] < starts[:, None]  # [bs, C]
        mask = torch.cat([ctx_ok[:, None, :].expand(bs, n, c), tree.ancestors], dim=-1)[:, None]  # [bs,1,N,C+N]
    else:
        cfg, scale = target.config, getattr(target.backbone.layers[0].self_attn, "scaling", None)
        cascade.plan(starts, tree.ancestors, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                     head_dim=hd, dtype=x.dtype, scale=hd ** -0.5 if scale is None else scale, context=c,
                     page_size=cache.capacity)
    capture = set(target.capture_layer_ids)
    captured: dict[int, torch.Tensor] = {}
    node_kv = []
    for i, layer in enumerate(target.backbone.layers):
        attn = layer.self_attn
        h = _norm(layer.input_layernorm, x)
        q = attn.q_proj(h).view(bs, n, -1, hd)
        k = attn.k_proj(h).view(bs, n, -1, hd)
        v = attn.v_proj(h).view(bs, n, -1, hd)
        if hasattr(attn, "q_norm"):
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)  # [bs, kvh, N, hd]
        node_kv.append((k, v))
        if cascade is None:
            ck, cv = cache.view(i, bs, c)
            out = attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2), mask, scale=getattr(attn, "scaling", None))
        else:
            out = cascade.run(q, k, v, cache.k[i], cache.v[i])
        x = x + attn.o_proj(out.transpose(1, 2).reshape(bs * n, -1))
        x = x + layer.mlp(_norm(layer.post_attention_layernorm, x))
        if i in capture:
            captured[i] = x
    x = _norm(target.backbone.norm, x)
    if target.num_layers - 1 in capture:
        captured[target.num_layers - 1] = x
    aux = None
    if target.capture_layer_ids:
        aux = torch.cat([captured[i] for i in target.capture_layer_ids], dim=-1).view(bs, n, -1)
    return TreeForward(x.view(bs, n, -1), aux, node_kv, target.lm_head)


@torch.inference_mode()
def commit_paths(cache: SlotKVCache, node_kv, paths: torch.Tensor, starts: torch.Tensor) -> None:
    """Write each row's path nodes' K/V at starts + 0, 1, ... paths [bs, P] node indices.

    Entries past a row's real path (padding) land beyond its committed length, where nothing
    reads them before the next step overwrites them.
    """
    bs, p = paths.shape
    pos = starts[:, None] + torch.arange(p, device=paths.device)[None]
    slots = torch.arange(bs, device=paths.device)
    for layer, (k, v) in enumerate(node_kv):
        idx = paths[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        cache.write_slots(layer, slots, pos, k.gather(2, idx), v.gather(2, idx))


def gather_nodes(values: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """values [bs, N, D], paths [bs, P] -> [bs, P, D]."""
    return values.gather(1, paths[..., None].expand(-1, -1, values.shape[-1]))
