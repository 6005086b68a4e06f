"""Tree attention in two levels: the request's committed context, then the tree's own nodes.

Every node of a request's tree attends to all of that request's committed context (a prefix
the whole tree shares: no mask there beyond its length) and, among the tree's nodes, to its
ancestors and itself. Attention over the union of two key sets is the two per-set results
merged by their log-sum-exp: with o_a, s_a over set A and o_b, s_b over set B,

    s = log(exp(s_a) + exp(s_b)),   o = (exp(s_a - s) o_a + exp(s_b - s) o_b),

which is cascade (shared-prefix) attention. The point on a GPU: the context level, the long one,
needs no per-node mask and runs a plain prefill kernel straight over the slot cache, and only the
short node level carries the ancestor mask.

Backends, chosen per step by `select`:
- `flashinfer` (CUDA, FlashInfer installed, float16 or bfloat16, head size 64, 128 or 256): the context level is
  FlashInfer's paged prefill over the slot cache, whose per-layer [slots, kv_heads, capacity,
  head_dim] tensors are its "HND" paged layout with one page per slot (page size = capacity,
  last page length = the committed length); the node level is its ragged prefill with the
  ancestor matrix as the custom mask; `merge_state` joins them. One plan per step serves every
  layer.
- `torch`: the same two levels and merge in plain torch (softmax in float32 at least). It is the reference
  the FlashInfer path is tested against, and a check that the decomposition is exact.
- `masked` (the default elsewhere, and on CPU): no cascade; tree_target's one padded attention
  call over [context ; nodes] with the full mask.
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("auto", "masked", "torch", "flashinfer")
_HALF = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes its prefill kernels are built for


@functools.cache
def _flashinfer():
    try:
        import flashinfer  # type: ignore[import-not-found]
    except Exception:  # not installed, or built without kernels for this device
        return None
    return flashinfer


def flashinfer_available(device: torch.device | str, dtype: torch.dtype, head_dim: int = 128) -> bool:
    return (torch.device(device).type == "cuda" and dtype in _HALF and head_dim in FLASHINFER_HEAD_DIMS
            and _flashinfer() is not None)


def select(backend: str, device: torch.device | str, dtype: torch.dtype, head_dim: int = 128) -> str:
    """The backend a step uses: `auto` is flashinfer where it fits, else masked."""
    if backend not in BACKENDS:
        raise ValueError(f"tree attention must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flashinfer" if flashinfer_available(device, dtype, head_dim) else "masked"
    if backend == "flashinfer" and not flashinfer_available(device, dtype, head_dim):
        raise ValueError("tree attention 'flashinfer' needs a CUDA device, the flashinfer package, float16 or "
                         f"bfloat16 weights and a head size in {FLASHINFER_HEAD_DIMS} (got "
                         f"{torch.device(device).type}, {dtype}, head size {head_dim})")
    return backend


def merge(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor, s_b: torch.Tensor):
    """Join attention results over two disjoint key sets. o [..., hd], s [...] natural-log LSE."""
    s = torch.logaddexp(s_a, s_b)
    w_a, w_b = torch.exp(s_a - s)[..., None], torch.exp(s_b - s)[..., None]
    return w_a * o_a + w_b * o_b, s


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [bs, nh, Q, hd], k/v [bs, kvh, S, hd], mask broadcastable to [bs, 1, Q, S] -> o [bs, nh, Q, hd]
    (in float32 at least) and its LSE [bs, nh, Q] (-inf, with o = 0, for a query that sees no key)."""
    group = q.shape[1] // k.shape[1]
    dt = torch.promote_types(q.dtype, torch.float32)
    k, v = k.to(dt).repeat_interleave(group, 1), v.to(dt).repeat_interleave(group, 1)
    scores = (q.to(dt) @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # a query that sees nothing gives o = 0
    return torch.exp(scores - finite[..., None]) @ v, lse


class TorchCascade:
    """The two levels and the merge in torch; `plan` once per step, `run` once per layer."""

    def plan(self, starts: torch.Tensor, ancestors: torch.Tensor, *, num_heads: int, num_kv_heads: int,
             head_dim: int, dtype: torch.dtype, scale: float, context: int, page_size: int) -> None:
        self.scale, self.context = scale, context
        self.ctx_mask = (torch.arange(context, device=starts.device)[None] < starts[:, None])[:, None, None, :]
        self.node_mask = ancestors[:, None]  # [bs, 1, N, N]

    def run(self, q, node_k, node_v, cache_k, cache_v) -> torch.Tensor:
        """q [bs, nh, N, hd]; node k/v [bs, kvh, N, hd]; cache k/v: this layer's [slots, kvh, cap, hd]."""
        bs = q.shape[0]
        ck, cv = cache_k[:bs, :, : self.context], cache_v[:bs, :, : self.context]
        o_ctx, s_ctx = attend_with_lse(q, ck, cv, self.ctx_mask, self.scale)
        o_node, s_node = attend_with_lse(q, node_k, node_v, self.node_mask, self.scale)
        return merge(o_node, s_node, o_ctx, s_ctx)[0].to(q.dtype)


class FlashInferCascade:
    """FlashInfer's kernels for the two levels (module docstring); CUDA and half precision only."""

    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self, device: torch.device | str):
        fi = _flashinfer()
        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._ctx = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        self._nodes = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self._merge = fi.merge_state

    def plan(self, starts: torch.Tensor, ancestors: torch.Tensor, *, num_heads: int, num_kv_heads: int,
             head_dim: int, dtype: torch.dtype, scale: float, context: int, page_size: int) -> None:
        bs, n, _ = ancestors.shape
        lens = starts.to("cpu", torch.int32)  # plan() reads its index arrays on the host anyway
        if int(lens.min()) < 1:
            raise ValueError("cascade attention needs at least one committed token per request")
        qo = torch.arange(bs + 1, dtype=torch.int32) * n
        pages = torch.arange(bs + 1, dtype=torch.int32)  # request i reads page (= slot) i
        self._ctx.plan(qo, pages, pages[:-1].clone(), lens, num_heads, num_kv_heads, head_dim, page_size,
                       causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        self._nodes.plan(qo, qo, num_heads, num_kv_heads, head_dim, custom_mask=ancestors.reshape(-1),
                         sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)

    def run(self, q, node_k, node_v, cache_k, cache_v) -> torch.Tensor:
        bs, nh, n, hd = q.shape
        qf = q.transpose(1, 2).reshape(bs * n, nh, hd).contiguous()
        kf = node_k.transpose(1, 2).reshape(bs * n, -1, hd).contiguous()
        vf = node_v.transpose(1, 2).reshape(bs * n, -1, hd).contiguous()
        o_node, s_node = self._nodes.run(qf, kf, vf, return_lse=True)
        o_ctx, s_ctx = self._ctx.run(qf, (cache_k, cache_v), return_lse=True)
        # merge_state runs one thread block per token over all its heads, which caps the head count;
        # the merge is per (token, head), so it takes them as tokens of one head each
        out, _ = self._merge(o_node.reshape(-1, 1, hd), s_node.reshape(-1, 1), o_ctx.reshape(-1, 1, hd),
                             s_ctx.reshape(-1, 1))
        return out.view(bs, n, nh, hd).transpose(1, 2)


def make(backend: str, device: torch.device | str):
    """A cascade for a selected backend, or None for `masked`."""
    if backend == "masked":
        return None
    return FlashInferCascade(device) if backend == "flashinfer" else TorchCascade()
