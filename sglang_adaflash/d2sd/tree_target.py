"""One target forward over a batch of draft trees, and the commit of each accepted path's K/V.

The masked torch path: every tree node attends to its request's committed context and to its
own ancestors only (plus itself), at RoPE position cache_len + depth. Siblings share a
position, so a node's K/V are stored by its index instead: node i of a row sits in the slot
cache at cache_len + i, past the committed length, and the attention is one call per layer over
the cache's own view [0, context + N) with a mask that sees a row's committed context and its
node's ancestors there. The chain's nodes come first (tree.build_row), so node i of the chain is
already where a chain verify would have put it: a path along the chain commits with no copy,
and a path through a branch copies only its own nodes into place (commit_paths). Keeping the
nodes' K/V aside instead cost a copy of the context per layer (concatenated to the nodes')
and a gather per layer at every commit (the commit took 0.24 ms of a c=1 step on the embedded
pair, 0.16 with the nodes in the cache: benchmarks/d2sd/step_parts_lean*.json). A tree that
does not fit in the cache past the longest context keeps its K/V aside, as does a cascade
(cascade.py: FlashInfer's kernels on CUDA), which attends to the context and to the nodes
separately and merges the two, so the long context level needs no per-node mask. Either way the cache afterwards holds exactly what a
chain verify of the accepted path would have left.
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
    # per layer [bs, kvh, N, hd] x2 (RoPE'd), or None: they sit in the cache at starts + node index
    node_kv: list[tuple[torch.Tensor, torch.Tensor]] | None
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

    def nodes_kv(self, cache: SlotKVCache, starts: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's node K/V [bs, kvh, N, hd] x2 wherever they sit (copies from the cache;
        valid until the next write past the committed lengths)."""
        if self.node_kv is not None:
            return self.node_kv
        bs, n = self.hidden.shape[:2]
        slots = torch.arange(bs, device=starts.device)[:, None]
        pos = starts[:, None] + torch.arange(n, device=starts.device)[None]
        return [(k[slots, :, pos].transpose(1, 2), v[slots, :, pos].transpose(1, 2)) for k, v in zip(cache.k, cache.v)]


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
    in_cache = cascade is None and c + n <= cache.capacity
    mask, node_kv = None, None if in_cache else []
    if in_cache:  # node i of row b at cache position starts[b] + i (see the module docstring)
        span = c + n
        rel = torch.arange(span, device=dev)[None] - starts[:, None]  # [bs, S]: key's node index (< 0: context)
        seen = torch.cat([tree.ancestors, tree.ancestors.new_zeros(bs, n, 1)], -1)  # column n: never seen
        col = torch.where((rel >= 0) & (rel < n), rel, n)[:, None].expand(bs, n, span)
        mask = ((rel < 0)[:, None] | seen.gather(2, col))[:, None]  # [bs, 1, N, S]
        slots = torch.arange(bs, device=dev)[:, None].expand(bs, n).reshape(-1)
        at = (starts[:, None] + torch.arange(n, device=dev)[None]).reshape(-1)
    elif cascade is None:
        ctx_ok = torch.arange(c, device=dev)[None] < starts[:, None]  # [bs, C]
        mask = torch.cat([ctx_ok[:, None, :].expand(bs, n, c), tree.ancestors], dim=-1)[:, None]  # [bs,1,N,C+N]
    else:
        cfg, scale = target.config, getattr(target.backbone.layers[0].self_attn, "scaling", None)
        cascade.plan(starts, tree.ancestors, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                     head_dim=hd, dtype=x.dtype, scale=hd ** -0.5 if scale is None else scale, context=c,
                     page_size=cache.capacity)
    capture = set(target.capture_layer_ids)
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(target.backbone.layers):
        attn = layer.self_attn
        h = _norm(layer.input_layernorm, x)
        q = attn.q_proj(h).view(bs, n, -1, hd)
        k = attn.k_proj(h).view(bs, n, -1, hd)
        v = attn.v_proj(h).view(bs, n, -1, hd)
        if hasattr(attn, "q_norm"):
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin)  # k [bs, N, kvh, hd]
        scale = getattr(attn, "scaling", None)
        if in_cache:
            cache.write_flat(i, slots, at, k.reshape(bs * n, -1, hd), v.reshape(bs * n, -1, hd))
            ck, cv = cache.view(i, bs, span)
            out = attention(q, ck, cv, mask, scale=scale)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [bs, kvh, N, hd]
            node_kv.append((k, v))
            if cascade is None:
                ck, cv = cache.view(i, bs, c)
                out = attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2), mask, scale=scale)
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
def commit_paths(cache: SlotKVCache, fwd: TreeForward, paths: torch.Tensor, starts: torch.Tensor) -> None:
    """Put each row's path nodes' K/V at starts + 0, 1, ... paths [bs, P] node indices, on the
    host, each row padded past its path with the identity (node d at depth d).

    K/V kept in the cache by node index move only for the rows whose path leaves the chain (a
    chain node d is at depth d already); padding entries then copy a node onto itself or land
    beyond the row's committed length, where nothing reads them before the next step writes
    there. K/V kept aside are written for every row.
    """
    bs, p = paths.shape
    dev = starts.device
    depth = torch.arange(p)[None]
    if fwd.node_kv is None:
        moved = (paths != depth).any(1).nonzero().flatten()
        if moved.numel() == 0:
            return
        rows = moved.to(dev)[:, None]
        src, dst = starts[rows] + paths[moved].to(dev), starts[rows] + depth.to(dev)
        for k, v in zip(cache.k, cache.v):
            k[rows, :, dst] = k[rows, :, src]  # the right side is read before anything is written
            v[rows, :, dst] = v[rows, :, src]
        return
    pos = starts[:, None] + depth.to(dev)
    slots = torch.arange(bs, device=dev)
    index = paths.to(dev)
    for layer, (k, v) in enumerate(fwd.node_kv):
        idx = index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        cache.write_slots(layer, slots, pos, k.gather(2, idx), v.gather(2, idx))


def gather_nodes(values: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """values [bs, N, D], paths [bs, P] -> [bs, P, D]."""
    return values.gather(1, paths[..., None].expand(-1, -1, values.shape[-1]))
