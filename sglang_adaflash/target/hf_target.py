"""Runs a local Hugging Face causal LM as the verifying target, over ragged per-request batches.

We keep HF's modules and weights but drive them ourselves: tokens of all requests are packed
(no padding) through every projection and MLP, so verify compute scales with the tokens actually
verified; only attention sees a padded [bs, Q] layout over the slot KV cache. The runner also
captures the residual stream after `capture_layer_ids` (HF's `hidden_states[id + 1]`), which is
the drafter's context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.kv_cache import SlotKVCache
from ..core.layers import apply_rope, attention, rms_norm

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


class TargetError(ValueError):
    """A target model directory we cannot serve; the message says why."""


@dataclass
class TargetBatch:
    """One ragged forward. Requests are slots 0..bs-1 of the cache."""

    # [bs, Q] token ids, padded past each request's q_len
    input_ids: torch.Tensor
    # [bs] positions of each request's first token (= its committed cache length)
    starts: torch.Tensor
    # [bs] tokens per request
    q_lens: torch.Tensor
    # cache slot of request 0 (requests use consecutive slots)
    slot_offset: int = 0

    @classmethod
    def from_lists(
        cls, tokens: list[list[int]], starts: list[int], device="cpu", slot_offset: int = 0
    ) -> TargetBatch:
        q = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), q, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        return cls(
            input_ids=ids.to(device),
            starts=torch.tensor(starts, dtype=torch.long, device=device),
            q_lens=torch.tensor([len(t) for t in tokens], dtype=torch.long, device=device),
            slot_offset=slot_offset,
        )

    @property
    def positions(self) -> torch.Tensor:  # [bs, Q]
        q = self.input_ids.shape[1]
        return self.starts[:, None] + torch.arange(q, device=self.starts.device)[None]

    @property
    def valid(self) -> torch.Tensor:  # [bs, Q] bool
        q = self.input_ids.shape[1]
        return torch.arange(q, device=self.q_lens.device)[None] < self.q_lens[:, None]


class HFTarget:
    """A causal LM from a local directory, verified-forward with captured hidden states."""

    def __init__(self, model: nn.Module, *, path: str | None = None):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise TargetError(
                f"target model_type {cfg.model_type!r} is not supported; supported families: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model.eval()
        self.config = cfg
        self.path = path
        self.backbone = model.model
        self.capture_layer_ids: list[int] = []

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None, device="cpu") -> HFTarget:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise TargetError(f"{path} is not a Hugging Face model directory: config.json is missing")
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise TargetError(
                f"{path}: model_type {cfg.model_type!r} is not supported; use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or "auto")
        return cls(model.to(device), path=str(path))

    # -- facts the compatibility check and the engine need ----------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def embed_tokens(self) -> nn.Module:
        return self.backbone.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads

    def new_cache(self, num_slots: int, capacity: int) -> SlotKVCache:
        return SlotKVCache(
            self.num_layers,
            self.config.num_key_value_heads,
            self.head_dim,
            num_slots=num_slots,
            capacity=capacity,
            dtype=self.dtype,
            device=self.device,
        )

    # -- the ragged forward -----------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, batch: TargetBatch, cache: SlotKVCache, logits_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns logits [T, V] (or [len(logits_rows), V]) and captured hidden states [T, K*H]
        (or None), T = sum(q_lens).

        Rows are packed request by request in order. Writes each token's K/V into the cache at its
        position; the caller commits by setting cache lengths afterwards.
        """
        q_lens, starts = batch.q_lens.tolist(), batch.starts.tolist()  # one host sync
        valid, positions = batch.valid, batch.positions
        uniform = min(q_lens) == max(q_lens)  # no padded query: views suffice
        flat_pos = positions.reshape(-1) if uniform else positions[valid]  # [T]
        slots = batch.slot_offset + torch.arange(len(q_lens), device=valid.device)[:, None].expand_as(valid)
        flat_slots = slots.reshape(-1) if uniform else slots[valid]  # [T]
        x = self.embed_tokens(batch.input_ids.reshape(-1) if uniform else batch.input_ids[valid])  # [T, H]
        cos, sin = self.backbone.rotary_emb(x[None], flat_pos[None])  # [1, T, hd]
        kv_len = max(st + n for st, n in zip(starts, q_lens))
        ragged, mask, singles = None, None, None
        if _prefer_ragged_attention(q_lens, starts, x.device.type):  # no compute on padded queries or keys
            offsets = [0]
            for n in q_lens[:-1]:
                offsets.append(offsets[-1] + n)
            ragged = [
                (batch.slot_offset + i, off, n, st + n, _causal_tail_mask(n, st + n, x.device))
                for i, (off, n, st) in enumerate(zip(offsets, q_lens, starts))
            ]
            if sum(n == 1 for n in q_lens) > 1:
                # rows verifying one token (undrafted requests beside drafted ones) share one
                # single-query call over the batch's cache views, as in a plain decode step
                first = torch.tensor(offsets, device=x.device)
                key_pos = torch.arange(kv_len, device=x.device)
                mask1 = (key_pos[None, :] <= batch.starts[:, None])[:, None, None]  # [bs, 1, 1, S]
                one = torch.tensor([n == 1 for n in q_lens], device=x.device)
                singles = (first, mask1, one, first[one])
                ragged = [r for r in ragged if r[2] > 1]
        else:
            # key position <= query position; padded queries see key 0 at least (output dropped)
            key_pos = torch.arange(kv_len, device=x.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [bs, 1, Q, S]
        ctx = _Step(batch, None if uniform else valid, flat_slots, flat_pos, cache, kv_len, mask,
                    cos[0, :, None], sin[0, :, None], ragged, singles)
        captured = {}
        capture = set(self.capture_layer_ids)
        for i, layer in enumerate(self.backbone.layers):
            x = x + self._attention(layer, i, _norm(layer.input_layernorm, x), ctx)
            x = x + layer.mlp(_norm(layer.post_attention_layernorm, x))
            if i in capture:
                captured[i] = x
        x = _norm(self.backbone.norm, x)
        if self.num_layers - 1 in capture:  # HF's last hidden_states entry is the normed one
            captured[self.num_layers - 1] = x
        logits = self.lm_head(x if logits_rows is None else x[logits_rows])
        aux = None
        if self.capture_layer_ids:
            aux = torch.cat([captured[i] for i in self.capture_layer_ids], dim=-1)
        return logits, aux

    def _attention(self, layer, idx: int, h: torch.Tensor, ctx: _Step) -> torch.Tensor:
        attn = layer.self_attn
        t, hd = h.shape[0], self.head_dim
        q = attn.q_proj(h).view(t, -1, hd)
        k = attn.k_proj(h).view(t, -1, hd)
        v = attn.v_proj(h).view(t, -1, hd)
        if hasattr(attn, "q_norm"):
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q = apply_rope(q, ctx.cos, ctx.sin)
        k = apply_rope(k, ctx.cos, ctx.sin)
        ctx.cache.write_flat(idx, ctx.slots, ctx.positions, k, v)
        scale = getattr(attn, "scaling", None)
        if ctx.ragged is not None:
            return attn.o_proj(self._ragged_attention(idx, q, ctx, scale))
        bs, qmax = ctx.batch.input_ids.shape
        if ctx.valid is None:
            q_pad = q.view(bs, qmax, -1, hd)
        else:
            q_pad = q.new_zeros(bs, qmax, q.shape[1], hd)
            q_pad[ctx.valid] = q
        ck, cv = ctx.cache.view(idx, bs, ctx.kv_len, offset=ctx.batch.slot_offset)
        out = attention(q_pad.transpose(1, 2), ck, cv, ctx.mask, scale=scale)
        out = out.transpose(1, 2)
        out = out.reshape(t, -1) if ctx.valid is None else out[ctx.valid].reshape(t, -1)  # [T, nh*hd]
        return attn.o_proj(out)

    @staticmethod
    def _ragged_attention(idx: int, q: torch.Tensor, ctx: _Step, scale) -> torch.Tensor:
        """One attention call per request over its own cache view: q [T, nh, hd] -> [T, nh*hd]."""
        k_all, v_all = ctx.cache.k[idx], ctx.cache.v[idx]
        if ctx.singles is None:
            outs = []
            for slot, off, n, kv_len, mask in ctx.ragged:
                qi = q[off : off + n].transpose(0, 1)[None]  # [1, nh, n, hd]
                ki, vi = k_all[slot : slot + 1, :, :kv_len], v_all[slot : slot + 1, :, :kv_len]
                outs.append(attention(qi, ki, vi, mask, scale=scale)[0].transpose(0, 1).reshape(n, -1))
            return torch.cat(outs)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        first, mask1, one, single_rows = ctx.singles
        ck, cv = ctx.cache.view(idx, first.shape[0], ctx.kv_len, offset=ctx.batch.slot_offset)
        # every row's first query (a multi-token row's is recomputed below and overwritten)
        o = attention(q[first][:, :, None], ck, cv, mask1, scale=scale)  # [bs, nh, 1, hd]
        out[single_rows] = o[one].flatten(1)
        for slot, off, n, kv_len, mask in ctx.ragged:
            qi = q[off : off + n].transpose(0, 1)[None]  # [1, nh, n, hd]
            ki, vi = k_all[slot : slot + 1, :, :kv_len], v_all[slot : slot + 1, :, :kv_len]
            out[off : off + n] = attention(qi, ki, vi, mask, scale=scale)[0].transpose(0, 1).reshape(n, -1)
        return out


def _prefer_ragged_attention(q_lens: list[int], starts: list[int], device_type: str = "cpu") -> bool:
    """On a CPU, per-request attention calls beat one padded call once padding wastes a quarter
    of it: there the padded queries' and keys' arithmetic is the cost.

    On any other device one padded call is taken always. Each per-request call is several kernel
    launches per layer, and a launch costs more than the padded arithmetic: on the first H200
    run (benchmarks/gpu/README.md) a dflash step at c=32 took 40 ms against plain decoding's 8,
    with about 1,700 more torch ops a step than at c=1, nearly all of them this loop's. Single-
    token rows (plain decoding) always take the padded call: it is cheap and one call.
    """
    if device_type != "cpu":
        return False
    q_max = max(q_lens)
    if q_max == 1 or len(q_lens) == 1:
        return False
    s_max = max(st + n for st, n in zip(starts, q_lens))
    useful = sum(n * (st + n) for st, n in zip(starts, q_lens))
    return useful < 0.75 * len(q_lens) * q_max * s_max


def _causal_tail_mask(q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """[1, 1, q_len, kv_len]: query j (at position kv_len - q_len + j) sees keys up to itself.

    None for a single query, which sees every key in its view.
    """
    if q_len == 1:
        return None
    key = torch.arange(kv_len, device=device)[None]
    query = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return (key <= query)[None, None]


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's Qwen3/Llama RMSNorm computed by our fused helper (same maths, fewer kernels)."""
    return rms_norm(x, module.weight, module.variance_epsilon)


@dataclass
class _Step:
    """Per-forward values every layer's attention needs."""

    batch: TargetBatch
    valid: torch.Tensor | None  # [bs, Q] bool, None when no request is padded
    slots: torch.Tensor  # [T] cache slot of each packed token
    positions: torch.Tensor  # [T]
    cache: SlotKVCache
    kv_len: int
    mask: torch.Tensor | None  # [bs, 1, Q, S] for the padded path
    cos: torch.Tensor  # [T, 1, hd]
    sin: torch.Tensor
    # per request (slot, first packed row, q_len, kv_len, mask) when q_lens differ, else None
    ragged: list | None = None
    # (first packed row of every request, its [bs, 1, 1, S] mask, which rows have q_len 1, their
    # packed rows) when single-token rows share one call on the ragged path, else None
    singles: tuple | None = None
