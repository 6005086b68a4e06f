"""The first and the recovery drafter run as one forward (`--branch-drafter joint`).

The recovery drafter's block for the slot-1 recovery point holds the last committed token and
masks from slot 1 on: exactly the first drafter's block. That branch therefore needs nothing
from the chain, and both drafters can read the same block in the same pass. Both are DFlash
drafters of one shape, so their weights are stacked along a leading axis of two and every
matmul of the pass is one batched matmul over the pair: the ops of one drafter forward, with
twice its arithmetic and twice the weights to read. The same holds for the projection of the
committed target features into both drafters' context K/V.

On the embedded pair (one CPU thread, a 250-token context) the stacked pass took 1.41 ms
against 1.09 for the first drafter's alone: the second drafter's weights are read every step,
and on that CPU a matmul of this size took 69 us with weights that do not stay in the core's
cache against 43 us with weights that do (benchmarks/d2sd/joint_micro.py).
A second, sequential recovery forward would add its own ops and its own launches on a GPU.

A recovery drafter that shares the first drafter's context modules (shared_context.py) needs
no second context: both read the first drafter's cache, and layer 0's block K/V, the same for
both, are made once (`_shared_layer`). That took the joint trees from 1.08-1.11x to
1.11-1.16x dflash's throughput at c=1 in the sweeps of benchmarks/d2sd/README.md. When that
layer is the last (a one-layer pair), the recovery drafter's part is made at the block rows a
branch reads only (`recovery_rows`, `_shared_last_layer`).

The stacked weights are copies. Hot reload copies new weights into the first drafter in place
(serving/reload/apply.py); every in-place write bumps a tensor's version counter, so the stack
is rebuilt whenever a parameter the stack was made from has a new version. The parameter list
is taken once (listing the modules' parameters on every call was a visible part of a step), so
replacing a parameter object instead of writing into it needs `refresh()`. Weights created
under inference_mode keep no version counter; those are restacked on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.layers import apply_rope, attention, rms_norm
from ..drafter.model import DFlashDrafter
from .shared_context import sharing

_SAME = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "rms_norm_eps", "rope_theta", "num_target_layers", "target_layer_ids", "block_size")
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def incompatibility(first: DFlashDrafter, recovery: DFlashDrafter) -> str | None:
    """Why the two cannot run as one stacked forward, or None."""
    for name in _SAME:
        a, b = getattr(first.config, name), getattr(recovery.config, name)
        if a != b:
            return f"{name} is {a} in the first drafter and {b} in the recovery drafter"
    if first.fc.weight.dtype != recovery.fc.weight.dtype or first.fc.weight.device != recovery.fc.weight.device:
        return "the two drafters are loaded with different dtypes or devices"
    return None


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [2, ..., D] with per-drafter weights w [2, D] (core.layers.rms_norm's numerics)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    else:
        y = F.rms_norm(x, (x.shape[-1],), None, eps)
    return y * w.view(2, *([1] * (x.dim() - 2)), w.shape[-1])


class JointDrafters:
    """Two same-shaped DFlash drafters as one: `forward` and `context_kv` return both results."""

    def __init__(self, first: DFlashDrafter, recovery: DFlashDrafter):
        why = incompatibility(first, recovery)
        if why is not None:
            raise ValueError(f"the drafters cannot run jointly: {why}")
        self.first, self.recovery = first, recovery
        cfg = first.config
        self.eps, self.hd = cfg.rms_norm_eps, cfg.head_dim
        self.nh, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.rebuilds = 0  # tests read it
        self.refresh()

    def refresh(self) -> None:
        """Take the parameters again and restack (after parameters were replaced, not written)."""
        self._params = [p for d in (self.first, self.recovery) for p in d.parameters()]
        # the recovery drafter uses the first's context modules, or its layer-0 attention too
        # (shared_context.py): that part of layer 0 is then one drafter's work, not two
        self.shared = sharing(self.first, self.recovery)
        # weights made under inference_mode keep no version counter: restacked on every call
        self._untracked = any(p.is_inference() for p in self._params)
        self._stamp = None

    def _weights(self) -> dict:
        stamp = None if self._untracked else [p._version for p in self._params]
        if stamp is None or stamp != self._stamp:
            self._stack()
            self._stamp = stamp
        return self._w

    @torch.inference_mode()
    def _stack(self) -> None:
        pair = (self.first, self.recovery)
        w: dict = {"fc": torch.stack([d.fc.weight.t() for d in pair]).contiguous(),
                   "hidden_norm": torch.stack([d.hidden_norm.weight for d in pair]),
                   "norm": torch.stack([d.norm.weight for d in pair]), "layers": []}
        for i in range(len(self.first.layers)):
            layer = {}
            for name in _LINEARS:  # [2, in, out]: x [2, T, in] @ it is each drafter's Linear
                layer[name] = torch.stack([d.layers[i].get_submodule(name).weight.t() for d in pair]).contiguous()
            for name in _NORMS:
                layer[name] = torch.stack([d.layers[i].get_submodule(name).weight for d in pair])
            w["layers"].append(layer)
        self._w = w
        self.rebuilds += 1

    def _kv(self, layer: dict, x: torch.Tensor, cos, sin):
        """x [2, n, S, H] -> k, v [2, n, kvh, S, hd] (k normed and rotated)."""
        two, n, s, h = x.shape
        k = torch.bmm(x.reshape(2, n * s, h), layer["self_attn.k_proj"]).view(2, n, s, self.kvh, self.hd)
        v = torch.bmm(x.reshape(2, n * s, h), layer["self_attn.v_proj"]).view(2, n, s, self.kvh, self.hd)
        k = apply_rope(_norm(k, layer["self_attn.k_norm"], self.eps), cos, sin)
        return k.transpose(2, 3), v.transpose(2, 3)

    @torch.inference_mode()
    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor):
        """Target features [n, A, K*H] at positions [n, A] -> (first's, recovery's) per-layer
        context K/V, each [(k, v)] with k, v [n, kvh, A, hd]: DFlashDrafter.context_kv of
        project_context for each drafter."""
        w = self._weights()
        n, a, kh = target_hidden.shape
        x = target_hidden.to(w["fc"].dtype).reshape(1, n * a, kh).expand(2, -1, -1)
        ctx = _norm(torch.bmm(x, w["fc"]), w["hidden_norm"], self.eps).view(2, n, a, -1)
        cos, sin = self.first.rope(positions, ctx.dtype)
        cos, sin = cos[None, :, :, None], sin[None, :, :, None]
        out = ([], [])
        for layer in w["layers"]:
            k, v = self._kv(layer, ctx, cos, sin)
            for d in range(2):
                out[d].append((k[d], v[d]))
        return out

    @torch.inference_mode()
    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_first, ctx_recovery,
                mask: torch.Tensor, recovery_rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Both drafters over the same block: block_embeds [N, Q, H], block_positions [N, Q],
        ctx_first / ctx_recovery per layer ([N, kvh, C, hd] x2), mask [N, 1, Q, C+Q] ->
        (first's, recovery's) final normed block states, each [N, Q, H]; with recovery_rows,
        the recovery drafter's at those block rows only, [N, R, H] (see _shared_last_layer)."""
        w = self._weights()
        n, q_len, h = block_embeds.shape
        x = block_embeds.to(w["fc"].dtype)[None].expand(2, -1, -1, -1)  # [2, N, Q, H]
        cos, sin = self.first.rope(block_positions, x.dtype)
        cos, sin = cos[None, :, :, None], sin[None, :, :, None]
        mask2 = None
        for i, (layer, (ca, va), (cb, vb)) in enumerate(zip(w["layers"], ctx_first, ctx_recovery)):
            if i == 0 and self.shared:
                if recovery_rows is not None and len(w["layers"]) == 1:
                    return self._shared_last_layer(layer, x, ca, va, cos, sin, mask, recovery_rows, w["norm"])
                x = self._shared_layer(layer, x, ca, va, cos, sin, mask)
                continue
            hs = _norm(x, layer["input_layernorm"], self.eps)
            bk, bv = self._kv(layer, hs, cos, sin)  # [2, N, kvh, Q, hd]
            q = torch.bmm(hs.reshape(2, n * q_len, h), layer["self_attn.q_proj"]).view(2, n, q_len, self.nh, self.hd)
            q = apply_rope(_norm(q, layer["self_attn.q_norm"], self.eps), cos, sin).transpose(2, 3)
            k = torch.cat([torch.cat([ca, cb]), bk.flatten(0, 1)], dim=2)  # [2N, kvh, C+Q, hd]
            v = torch.cat([torch.cat([va, vb]), bv.flatten(0, 1)], dim=2)
            if mask2 is None:  # both drafters' rows: the same mask twice
                mask2 = mask.expand(n, 1, q_len, mask.shape[-1]).repeat(2, 1, 1, 1)
            out = attention(q.flatten(0, 1), k, v, mask2)  # [2N, nh, Q, hd]
            out = out.view(2, n, self.nh, q_len, self.hd).transpose(2, 3).reshape(2, n * q_len, -1)
            x = x + torch.bmm(out, layer["self_attn.o_proj"]).view(2, n, q_len, h)
            x = self._mlp(layer, x)
        x = _norm(x, w["norm"], self.eps)
        return x[0], x[1] if recovery_rows is None else x[1][:, recovery_rows]

    def _shared_last_layer(self, layer: dict, x: torch.Tensor, ctx_k, ctx_v, cos, sin, mask, rows: slice,
                           norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-layer pair with shared modules, the recovery drafter's part at block `rows`
        only: its queries, attention output, MLP and final norm there, since a branch reads
        its states at those slots alone (the block K/V are shared and made for every row).
        On the embedded pair that is 2 of 16 rows; the stacked MLP over all 32 rows was the
        pass's largest matmuls. Returns (first's [N, Q, H], recovery's [N, R, H])."""
        _, n, q_len, h = x.shape
        x0 = x[0]
        hs, k, v = self._shared_kv(layer, x0, ctx_k, ctx_v, cos, sin)
        x_r = x[1][:, rows]
        r_len = x_r.shape[1]
        if self.shared == "attention":  # one attention output, the first drafter's, for both
            q = self._query(layer, hs, 0, cos[0], sin[0]).transpose(1, 2)
            att = (attention(q, k, v, mask).transpose(1, 2).reshape(n, q_len, -1) @ layer["self_attn.o_proj"][0])
            x_f, x_r = x0 + att, x_r + att[:, rows]
        else:  # both drafters' queries in one call, the recovery drafter's at `rows` only
            q_f = self._query(layer, hs, 0, cos[0], sin[0])
            q_r = self._query(layer, hs[:, rows], 1, cos[0][:, rows], sin[0][:, rows])
            q = torch.cat([q_f, q_r], dim=1).transpose(1, 2)  # [N, nh, Q + R, hd]
            out = attention(q, k, v, torch.cat([mask, mask[:, :, rows]], dim=2)).transpose(1, 2)
            x_f = x0 + out[:, :q_len].reshape(n, q_len, -1) @ layer["self_attn.o_proj"][0]
            x_r = x_r + out[:, q_len:].reshape(n, r_len, -1) @ layer["self_attn.o_proj"][1]
        outs = []
        for d, y in ((0, x_f), (1, x_r)):
            hs = rms_norm(y, layer["post_attention_layernorm"][d], self.eps)
            up = F.silu(hs @ layer["mlp.gate_proj"][d]) * (hs @ layer["mlp.up_proj"][d])
            outs.append(rms_norm(y + up @ layer["mlp.down_proj"][d], norm[d], self.eps))
        return outs[0], outs[1]

    def _shared_layer(self, layer: dict, x: torch.Tensor, ctx_k, ctx_v, cos, sin, mask) -> torch.Tensor:
        """Layer 0 when modules are shared (shared_context.py): both drafters see the same block
        input through the same input norm and K/V projections, so the block K/V are made once.
        With "context" both drafters' queries attend them in one call (stacked along the query
        axis: every block row has the same mask row); with "attention" the attention output is
        one drafter's. x [2, N, Q, H] (the two identical) -> [2, N, Q, H]."""
        _, n, q_len, h = x.shape
        hs, k, v = self._shared_kv(layer, x[0], ctx_k, ctx_v, cos, sin)
        if self.shared == "attention":
            q = self._query(layer, hs, 0, cos[0], sin[0]).transpose(1, 2)
            out = attention(q, k, v, mask).transpose(1, 2).reshape(n, q_len, -1)
            x = x + (out @ layer["self_attn.o_proj"][0])[None]
        else:
            q = torch.bmm(hs.reshape(1, n * q_len, h).expand(2, -1, -1), layer["self_attn.q_proj"])
            q = apply_rope(_norm(q.view(2, n, q_len, self.nh, self.hd), layer["self_attn.q_norm"], self.eps), cos, sin)
            q = q.permute(1, 3, 0, 2, 4).reshape(n, self.nh, 2 * q_len, self.hd)  # [N, nh, 2Q, hd]
            out = attention(q, k, v, torch.cat([mask, mask], dim=2))
            out = out.view(n, self.nh, 2, q_len, self.hd).permute(2, 0, 3, 1, 4).reshape(2, n * q_len, -1)
            x = x + torch.bmm(out, layer["self_attn.o_proj"]).view(2, n, q_len, h)
        return self._mlp(layer, x)

    def _shared_kv(self, layer: dict, x0: torch.Tensor, ctx_k, ctx_v, cos, sin):
        """The shared input norm and block K/V, made once: x0 [N, Q, H] -> its normed states
        [N, Q, H] and the context's K/V with the block's appended, [N, kvh, C+Q, hd] x2."""
        n, q_len, _ = x0.shape
        hs = rms_norm(x0, layer["input_layernorm"][0], self.eps)
        k = (hs @ layer["self_attn.k_proj"][0]).view(n, q_len, self.kvh, self.hd)
        k = apply_rope(rms_norm(k, layer["self_attn.k_norm"][0], self.eps), cos[0], sin[0]).transpose(1, 2)
        v = (hs @ layer["self_attn.v_proj"][0]).view(n, q_len, self.kvh, self.hd).transpose(1, 2)
        return hs, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)

    def _query(self, layer: dict, hs: torch.Tensor, d: int, cos, sin) -> torch.Tensor:
        """Drafter d's normed, rotated queries at the rows of hs [N, R, H] -> [N, R, nh, hd]."""
        n, r, _ = hs.shape
        q = (hs @ layer["self_attn.q_proj"][d]).view(n, r, self.nh, self.hd)
        return apply_rope(rms_norm(q, layer["self_attn.q_norm"][d], self.eps), cos, sin)

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        """The residual MLP block of both drafters, stacked: x [2, N, Q, H] -> [2, N, Q, H]."""
        hs = _norm(x, layer["post_attention_layernorm"], self.eps).flatten(1, 2)
        up = F.silu(torch.bmm(hs, layer["mlp.gate_proj"])) * torch.bmm(hs, layer["mlp.up_proj"])
        return x + torch.bmm(up, layer["mlp.down_proj"]).view(x.shape)
