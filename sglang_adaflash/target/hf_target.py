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
from safetensors import SafetensorError
from torch import nn

from ..core.kv_cache import SlotKVCache
from ..core.layers import apply_rope, attention, rms_norm
from .weight_layout import column_major_linears, column_major_tied_head

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


class TargetError(ValueError):
    """A target model directory we cannot serve; the message says why."""


@dataclass
class TargetBatch:
    """One ragged forward. Requests are slots 0..bs-1 of the cache.

    Built by :meth:`from_lists` (or :meth:`from_device_ids`), it also carries its layout on the
    host: the lengths and starts as lists, and where each packed token sits in the padded
    [bs, Q] layout as an index. The forward plans from those, so on an accelerator it reads
    nothing back from the device and needs no boolean-mask indexing, each of which is a
    synchronisation there (a mask's nonzero count sizes its result); the host values reach the
    device in one copy.
    """

    # [bs, Q] token ids, padded past each request's q_len
    input_ids: torch.Tensor
    # [bs] positions of each request's first token (= its committed cache length)
    starts: torch.Tensor
    # [bs] tokens per request
    q_lens: torch.Tensor
    # cache slot of request 0 (requests use consecutive slots)
    slot_offset: int = 0
    # host copies of q_lens and starts; read back from the device when not given
    q_lens_host: list[int] | None = None
    starts_host: list[int] | None = None
    # [T] long: packed token t sits at row-major position packed_index[t] of [bs, Q]; None when
    # not given (derived from q_lens) or when no request is padded
    packed_index: torch.Tensor | None = None

    @classmethod
    def from_lists(
        cls, tokens: list[list[int]], starts: list[int], device="cpu", slot_offset: int = 0
    ) -> TargetBatch:
        q_lens = [len(t) for t in tokens]
        q = max(q_lens)
        ids = [tok for t in tokens for tok in (*t, *([0] * (q - len(t))))]
        return cls._from_host(ids, None, starts, q_lens, device, slot_offset)

    @classmethod
    def from_device_ids(
        cls, first: list[int], rest: torch.Tensor, q_lens: list[int], starts: list[int], device, slot_offset: int = 0
    ) -> TargetBatch:
        """Row i verifies first[i] then rest[i, : q_lens[i] - 1]: rest [bs, >= max(q_lens) - 1] stays
        on the device (a speculative step's proposals need not visit the host before the verify)."""
        return cls._from_host(first, rest[:, : max(q_lens) - 1], starts, q_lens, device, slot_offset)

    @classmethod
    def _from_host(cls, ids: list[int], rest, starts: list[int], q_lens: list[int], device, slot_offset: int):
        bs, q = len(q_lens), max(q_lens)
        padded = min(q_lens) != q
        index = [i * q + j for i, n in enumerate(q_lens) for j in range(n)] if padded else []
        host = torch.tensor([*ids, *starts, *q_lens, *index], dtype=torch.long)
        kind = torch.device(device).type
        if kind == "cuda":  # one copy from pinned memory, queued without waiting for the device
            host = host.pin_memory().to(device, non_blocking=True)
        elif kind != "cpu":
            host = host.to(device)
        n_ids = len(ids)
        head, starts_t, lens_t, index_t = host.split([n_ids, bs, bs, len(index)])
        input_ids = head.view(bs, -1)
        if rest is not None:
            input_ids = torch.cat([input_ids, rest.to(input_ids.device, torch.long)], dim=1)
        return cls(input_ids=input_ids, starts=starts_t, q_lens=lens_t, slot_offset=slot_offset,
                   q_lens_host=list(q_lens), starts_host=list(starts), packed_index=index_t if padded else None)

    def host_layout(self) -> tuple[list[int], list[int]]:
        """(q_lens, starts) as lists: the host copies, else one read back from the device."""
        q_lens = self.q_lens_host if self.q_lens_host is not None else self.q_lens.tolist()
        starts = self.starts_host if self.starts_host is not None else self.starts.tolist()
        return q_lens, starts

    def packed_rows(self) -> torch.Tensor | None:
        """[T] row-major positions in [bs, Q] of the packed tokens; None when nobody is padded."""
        if self.packed_index is not None:
            return self.packed_index
        q_lens, _ = self.host_layout()
        if min(q_lens) == max(q_lens):
            return None
        return self.valid.reshape(-1).nonzero().flatten()

    @property
    def positions(self) -> torch.Tensor:  # [bs, Q]
        q = self.input_ids.shape[1]
        return self.starts[:, None] + torch.arange(q, device=self.starts.device)[None]

    @property
    def valid(self) -> torch.Tensor:  # [bs, Q] bool
        q = self.input_ids.shape[1]
        return torch.arange(q, device=self.q_lens.device)[None] < self.q_lens[:, None]


def pad_packed(flat: torch.Tensor, batch: TargetBatch) -> torch.Tensor:
    """Packed rows [T, D] of a batch -> padded [bs, Q, D] (zeros past each q_len)."""
    bs, q = batch.input_ids.shape
    index = batch.packed_rows()
    if index is None:  # no padding (e.g. a plain decode step): a view
        return flat.view(bs, q, flat.shape[-1])
    out = flat.new_zeros(bs * q, flat.shape[-1])
    out.index_copy_(0, index, flat)
    return out.view(bs, q, flat.shape[-1])


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
        # float32 on a CPU: the same weights, column-major, for MKL's faster few-row GEMM (weight_layout)
        self.relaid_linears = column_major_linears(model)
        # a head tied to the embedding gets its own column-major copy (weight_layout)
        self.head_copied = column_major_tied_head(model.lm_head, model.model.embed_tokens)
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
        try:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or "auto")
        except SafetensorError as e:  # transformers lets it through as is, traceback and all
            shards = sorted(path.glob("*.safetensors"))
            weights = shards[0] if len(shards) == 1 else f"a .safetensors file in {path}"
            raise TargetError(f"{weights} cannot be read as safetensors ({' '.join(str(e).split())}); it "
                              "is truncated or corrupt: copy the model directory again") from None
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
        q_lens, starts = batch.host_layout()
        positions = batch.positions
        packed = batch.packed_rows()  # None: no padded query, views suffice
        slots = batch.slot_offset + torch.arange(len(q_lens), device=positions.device)[:, None].expand_as(positions)
        flat_pos, flat_slots, flat_ids = positions.reshape(-1), slots.reshape(-1), batch.input_ids.reshape(-1)
        if packed is not None:
            flat_pos, flat_slots, flat_ids = flat_pos[packed], flat_slots[packed], flat_ids[packed]  # [T]
        x = self.embed_tokens(flat_ids)  # [T, H]
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
                one = [i for i, n in enumerate(q_lens) if n == 1]
                index = torch.tensor([*offsets, *one, *(offsets[i] for i in one)], device=x.device)
                first, one_rows, single_rows = index.split([len(offsets), len(one), len(one)])
                key_pos = torch.arange(kv_len, device=x.device)
                mask1 = (key_pos[None, :] <= batch.starts[:, None])[:, None, None]  # [bs, 1, 1, S]
                singles = (first, mask1, one_rows, single_rows)
                ragged = [r for r in ragged if r[2] > 1]
        else:
            # key position <= query position; padded queries see key 0 at least (output dropped)
            key_pos = torch.arange(kv_len, device=x.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [bs, 1, Q, S]
        ctx = _Step(batch, packed, flat_slots, flat_pos, cache, kv_len, mask,
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
        if ctx.packed is None:
            q_pad = q.view(bs, qmax, -1, hd)
        else:
            q_pad = q.new_zeros(bs * qmax, q.shape[1], hd).index_copy_(0, ctx.packed, q).view(bs, qmax, -1, hd)
        ck, cv = ctx.cache.view(idx, bs, ctx.kv_len, offset=ctx.batch.slot_offset)
        out = attention(q_pad.transpose(1, 2), ck, cv, ctx.mask, scale=scale)
        out = out.transpose(1, 2).reshape(bs * qmax, -1)
        return attn.o_proj(out if ctx.packed is None else out[ctx.packed])  # [T, nh*hd]

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
        first, mask1, one_rows, single_rows = ctx.singles
        ck, cv = ctx.cache.view(idx, first.shape[0], ctx.kv_len, offset=ctx.batch.slot_offset)
        # every row's first query (a multi-token row's is recomputed below and overwritten)
        o = attention(q[first][:, :, None], ck, cv, mask1, scale=scale)  # [bs, nh, 1, hd]
        out[single_rows] = o[one_rows].flatten(1)
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
    packed: torch.Tensor | None  # [T] positions in [bs * Q] of the packed tokens, None when none is padded
    slots: torch.Tensor  # [T] cache slot of each packed token
    positions: torch.Tensor  # [T]
    cache: SlotKVCache
    kv_len: int
    mask: torch.Tensor | None  # [bs, 1, Q, S] for the padded path
    cos: torch.Tensor  # [T, 1, hd]
    sin: torch.Tensor
    # per request (slot, first packed row, q_len, kv_len, mask) when q_lens differ, else None
    ragged: list | None = None
    # (first packed row of every request, its [bs, 1, 1, S] mask, the requests with q_len 1,
    # their packed rows) when single-token rows share one call on the ragged path, else None
    singles: tuple | None = None
