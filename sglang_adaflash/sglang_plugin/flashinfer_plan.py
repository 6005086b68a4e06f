"""The arrays a FlashInfer paged prefill takes for a ragged (compact) verify, and a reference.

FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan`` describes a batch by four arrays:

- ``qo_indptr`` [bs+1]: request i's query rows are ``qo_indptr[i]:qo_indptr[i+1]``, here its
  ``L_i`` packed verify tokens;
- ``kv_indptr`` [bs+1]: request i's pages are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``;
- ``kv_indices`` [nnz]: page ids of the paged KV cache, in sequence order;
- ``kv_last_page_len`` [bs]: valid tokens in each request's last page.

A verify reads the committed prefix and its own verify tokens, which SGLang writes into the KV
cache before attention, so request i's KV length is ``prefix_i + L_i``, and with a causal mask
query row j (absolute position ``prefix_i + j``) sees keys ``0..prefix_i + j``. That is
FlashInfer's bottom-right-aligned causal rule for ``q_len < kv_len``.

:func:`ragged_verify_plan` builds the arrays from SGLang's ``req_to_token`` table;
:func:`paged_attention_reference` is a slow torch attention that reads the cache by the same
arrays (the tests hold it against dense causal attention, and on a GPU against FlashInfer).
The plugin does not run a FlashInfer ragged verify yet: ``plan()`` needs these arrays on the
host, and the plugin keeps each request's verify length on the device (docs/sglang.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedVerifyPlan:
    qo_indptr: torch.Tensor  # [bs+1] int32
    kv_indptr: torch.Tensor  # [bs+1] int32
    kv_indices: torch.Tensor  # [nnz] int32 page ids
    kv_last_page_len: torch.Tensor  # [bs] int32, 1..page_size
    page_size: int

    @property
    def bs(self) -> int:
        return int(self.kv_last_page_len.shape[0])


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)


def ragged_verify_plan(
    verify_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    page_size: int = 1,
) -> PagedVerifyPlan:
    """verify_lens, prefix_lens, req_pool_indices [bs]; req_to_token [pool, max_len] holds each
    request's KV slot per position (SGLang's table; a page's slots are contiguous and its first
    slot is a multiple of ``page_size``)."""
    kv_lens = (prefix_lens + verify_lens).long()  # [bs]
    pages = (kv_lens + page_size - 1) // page_size  # [bs]
    rows = []
    for i in range(int(kv_lens.shape[0])):  # planning reference: clarity over speed
        slots = req_to_token[req_pool_indices[i], : int(kv_lens[i]) : page_size]
        rows.append(slots.long() // page_size)
    return PagedVerifyPlan(
        qo_indptr=_indptr(verify_lens.long()),
        kv_indptr=_indptr(pages),
        kv_indices=torch.cat(rows).to(torch.int32),
        kv_last_page_len=((kv_lens - 1) % page_size + 1).to(torch.int32),
        page_size=page_size,
    )


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedVerifyPlan,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of the packed queries q [T, Hq, D] over a paged cache
    k_cache/v_cache [pages, page_size, Hkv, D], read by the plan's arrays only."""
    out = torch.zeros_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    for i in range(plan.bs):
        q0, q1 = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        p0, p1 = int(plan.kv_indptr[i]), int(plan.kv_indptr[i + 1])
        pages = plan.kv_indices[p0:p1].long()
        kv_len = (p1 - p0 - 1) * plan.page_size + int(plan.kv_last_page_len[i])
        k = k_cache[pages].reshape(-1, hkv, k_cache.shape[-1])[:kv_len]
        v = v_cache[pages].reshape(-1, hkv, v_cache.shape[-1])[:kv_len]
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        qi = q[q0:q1]  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) * sm_scale
        pos = kv_len - (q1 - q0) + torch.arange(q1 - q0)  # absolute positions of the queries
        mask = torch.arange(kv_len)[None, :] > pos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
    return out
