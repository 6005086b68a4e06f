"""The arrays a FlashInfer paged prefill takes for a ragged (compact) verify, planned without
reading the device, and a reference that reads a paged cache by them.

FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` describes a batch by four arrays:

- ``qo_indptr`` [bs+1]: request i's query rows are ``qo_indptr[i]:qo_indptr[i+1]``, here its
  ``L_i`` packed verify tokens;
- ``kv_indptr`` [bs+1]: request i's pages are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``;
- ``kv_indices`` [nnz]: page ids of the paged KV cache, in sequence order;
- ``kv_last_page_len`` [bs]: valid tokens in each request's last page.

A verify reads the committed prefix and its own verify tokens, which SGLang writes into the KV
cache before attention, so request i's KV length is ``prefix_i + L_i``, and with a causal mask
query row j (absolute position ``prefix_i + j``) sees keys ``0..prefix_i + j``: FlashInfer's
bottom-right-aligned causal rule for ``q_len < kv_len``.

**Planning without the lengths.** ``plan()`` reads the two indptrs on the host to split the
work among thread blocks, while ADAFLASH keeps each ``L_i`` on the device (no host sync in a
decode step). FlashInfer 0.7.2's fa2 paged-prefill kernel (``prefill.cuh``) reads per work item

- the query rows at ``q + q_indptr[i]`` and ``qo_len``, ``kv_len`` from the *device* arrays it
  is run with (``_qo_indptr_buf``, ``_paged_kv_indptr_buf``, ``_paged_kv_last_page_len_buf``),
  masking the rows and keys past them;
- the output rows at ``o + o_indptr[i]``, where ``o_indptr`` is *planned on the host* from the
  host ``qo_indptr`` (and so are the split-KV merge offsets).

So a plan made from host **upper bounds** (``cap_i >= L_i``, known before drafting: the most a
request may verify; its KV bound ``prefix_i + cap_i``) covers every tile the exact batch needs,
the kernel computes on the exact device arrays, and request i's outputs land at
``bound_qo_indptr[i] + j`` of an output with ``sum(cap_i)`` rows: :func:`padded_rows` maps
them back to the packed rows. That is lossless and reads nothing back; the price is the
attention work of the masked tail tiles, not the model's (every other layer runs on the
packed rows). :func:`fa2_paged_prefill_reference` is this addressing written in torch, held
against dense attention by the tests (and on a GPU, FlashInfer itself).
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


@dataclass(frozen=True)
class HostBounds:
    """What the host knows of a ragged verify before it is drafted: per request an upper bound
    of its verify length and of its KV length (page size 1: pages are tokens). CPU tensors."""

    qo_indptr: torch.Tensor  # [bs+1] int32, cumsum(cap)
    kv_indptr: torch.Tensor  # [bs+1] int32, cumsum(kv_lens)
    kv_lens: torch.Tensor  # [bs] int32, prefix + cap

    @property
    def total_rows(self) -> int:
        return int(self.qo_indptr[-1])


def host_bounds(caps, kv_lens) -> HostBounds:
    """caps [bs]: most verify tokens per request; kv_lens [bs]: prefix + cap (host values)."""
    caps = torch.as_tensor(caps, dtype=torch.int32).cpu()
    kv = torch.as_tensor(kv_lens, dtype=torch.int32).cpu()
    return HostBounds(qo_indptr=_indptr(caps), kv_indptr=_indptr(kv), kv_lens=kv)


def padded_rows(qo_indptr: torch.Tensor, bound_qo_indptr: torch.Tensor, rows: int) -> torch.Tensor:
    """For packed row r (request i, slot j) its row ``bound_qo_indptr[i] + j`` in the output a
    bound-planned kernel writes; rows past the batch map to row 0 (padding, never read).

    qo_indptr, bound_qo_indptr: [bs+1] on one device; returns [rows] long there. Device only."""
    r = torch.arange(rows, device=qo_indptr.device)
    bs = qo_indptr.shape[0] - 1
    req = torch.searchsorted(qo_indptr[1:].long(), r, right=True).clamp(max=bs - 1)
    within = r - qo_indptr.long()[req]
    idx = bound_qo_indptr.long()[req] + within
    return torch.where(r < qo_indptr[-1].long(), idx, torch.zeros_like(idx))


def fa2_paged_prefill_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedVerifyPlan,
    bounds: HostBounds, sm_scale: float,
) -> torch.Tensor:
    """FlashInfer's fa2 paged prefill, as planned from ``bounds`` and run on ``plan``'s exact
    arrays: queries read at ``plan.qo_indptr``, lengths from ``plan``, outputs written at
    ``bounds.qo_indptr`` (the host-planned ``o_indptr``). q [bounds.total_rows, Hq, D] (the
    packed rows first); returns [bounds.total_rows, Hq, D], rows no request wrote zero."""
    out = torch.zeros_like(q)
    exact = paged_attention_reference(q[: int(plan.qo_indptr[-1])], k_cache, v_cache, plan,
                                      sm_scale)  # fmt: skip
    for i in range(plan.bs):
        q0, q1 = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        o0 = int(bounds.qo_indptr[i])
        assert q1 - q0 <= int(bounds.qo_indptr[i + 1]) - o0, "a bound below the verify length"
        out[o0 : o0 + q1 - q0] = exact[q0:q1]
    return out
