"""The FlashInfer paged-prefill arrays of a ragged verify, against dense causal attention.

CPU: a torch attention that reads the paged cache only through the planned arrays equals dense
causal attention over each request's tokens, for mixed verify lengths, page sizes 1 and 4, GQA,
and a shuffled cache. GPU (``gpu`` marker): FlashInfer's own kernel on the same arrays.
"""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.sglang_plugin import flashinfer_plan as fp

HQ, HKV, D = 4, 2, 8


def scene(page_size: int, seed: int = 0):
    """Requests with prefixes and ragged verify lengths, their tokens' q/k/v, a paged cache
    holding them in shuffled pages, and SGLang's req_to_token table."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.tensor([5, 0, 11, 3])
    verify = torch.tensor([3, 1, 6, 2])  # mixed lengths, one bonus-only request
    kv_lens = prefix + verify
    max_pages = 64
    perm = torch.randperm(max_pages, generator=g)
    k_cache = torch.zeros(max_pages, page_size, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    req_to_token = torch.zeros(8, 32, dtype=torch.int64)
    pool = torch.tensor([6, 2, 0, 5])  # request i lives in row pool[i]
    k_all, v_all, q_all = [], [], []
    next_page = 0
    for i, n in enumerate(kv_lens.tolist()):
        k = torch.randn(n, HKV, D, generator=g)
        v = torch.randn(n, HKV, D, generator=g)
        for start in range(0, n, page_size):
            page = int(perm[next_page])
            next_page += 1
            chunk = slice(start, min(n, start + page_size))
            k_cache[page, : chunk.stop - start] = k[chunk]
            v_cache[page, : chunk.stop - start] = v[chunk]
            req_to_token[pool[i], chunk] = page * page_size + torch.arange(chunk.stop - start)
        k_all.append(k)
        v_all.append(v)
        q_all.append(torch.randn(int(verify[i]), HQ, D, generator=g))
    return prefix, verify, pool, req_to_token, k_cache, v_cache, k_all, v_all, torch.cat(q_all)


def dense_reference(q, k_all, v_all, verify, sm_scale):
    """Causal attention over each request's whole token sequence; its last L rows."""
    out, row = [], 0
    for k, v, n in zip(k_all, v_all, verify.tolist()):
        qi = q[row : row + n]
        row += n
        k = k.repeat_interleave(HQ // HKV, 1)
        v = v.repeat_interleave(HQ // HKV, 1)
        full = k.shape[0]
        s = torch.einsum("qhd,khd->hqk", qi, k) * sm_scale
        allowed = torch.ones(n, full, dtype=torch.bool).tril(full - n)
        s = s.masked_fill(~allowed[None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize("page_size", [1, 4])
def test_planned_arrays_read_the_right_tokens(page_size):
    prefix, verify, pool, r2t, kc, vc, k_all, v_all, q = scene(page_size)
    plan = fp.ragged_verify_plan(verify, prefix, r2t, pool, page_size)
    assert plan.qo_indptr.tolist() == [0, 3, 4, 10, 12]
    kv_lens = (prefix + verify).tolist()
    assert plan.kv_last_page_len.tolist() == [(n - 1) % page_size + 1 for n in kv_lens]
    got = fp.paged_attention_reference(q, kc, vc, plan, sm_scale=D**-0.5)
    torch.testing.assert_close(got, dense_reference(q, k_all, v_all, verify, D**-0.5))


def test_an_off_by_one_indptr_is_caught():
    """Control: the same check rejects arrays that are off by one."""
    prefix, verify, pool, r2t, kc, vc, k_all, v_all, q = scene(1)
    plan = fp.ragged_verify_plan(verify, prefix, r2t, pool, 1)
    want = dense_reference(q, k_all, v_all, verify, D**-0.5)
    shifted = plan.kv_indptr.clone()
    shifted[1:-1] += 1
    bad = fp.PagedVerifyPlan(plan.qo_indptr, shifted, plan.kv_indices, plan.kv_last_page_len, 1)
    assert not torch.allclose(fp.paged_attention_reference(q, kc, vc, bad, D**-0.5), want)


@pytest.mark.gpu
def test_flashinfer_kernel_on_the_planned_arrays():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (FlashInfer has no CPU kernels)")
    flashinfer = pytest.importorskip("flashinfer")
    prefix, verify, pool, r2t, kc, vc, k_all, v_all, q = scene(4)
    plan = fp.ragged_verify_plan(verify, prefix, r2t, pool, 4)
    dev = torch.device("cuda")
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wrapper.plan(plan.qo_indptr.to(dev), plan.kv_indptr.to(dev), plan.kv_indices.to(dev),
                 plan.kv_last_page_len.to(dev), HQ, HKV, D, 4, causal=True,
                 q_data_type=torch.float16)  # fmt: skip
    out = wrapper.run(q.half().to(dev), (kc.half().to(dev), vc.half().to(dev)))
    want = fp.paged_attention_reference(q, kc, vc, plan, D**-0.5)
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
