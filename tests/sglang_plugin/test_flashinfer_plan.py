"""The FlashInfer paged-prefill arrays of a ragged verify, against dense causal attention.

CPU: a torch attention that reads the paged cache only through the planned arrays equals dense
causal attention over each request's tokens, for mixed verify lengths, page sizes 1 and 4, GQA,
and a shuffled cache; planned from host upper bounds (FlashInfer's fa2 addressing: queries and
lengths from the exact device arrays, outputs at the bound offsets), the outputs mapped back
to the packed rows are the same. GPU (``gpu`` marker): FlashInfer's own kernel on both.
"""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.sglang_plugin import flashinfer_plan as fp
from sglang_adaflash.sglang_plugin.flashinfer_verify import BoundsOutputWrapper, layout_bounds

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


CAPS = torch.tensor([5, 1, 8, 2])  # host bounds: >= the verify lengths [3, 1, 6, 2]


def bound_scene():
    prefix, verify, pool, r2t, kc, vc, k_all, v_all, q = scene(1)
    plan = fp.ragged_verify_plan(verify, prefix, r2t, pool, 1)
    bounds = fp.host_bounds(CAPS.tolist(), (prefix + CAPS).tolist())
    want = dense_reference(q, k_all, v_all, verify, D**-0.5)
    return plan, bounds, q, kc, vc, want


def padded(q, rows):
    out = q.new_zeros((rows, *q.shape[1:]))
    out[: q.shape[0]] = q
    return out


def test_a_plan_from_host_bounds_is_lossless_once_rows_are_mapped_back():
    plan, bounds, q, kc, vc, want = bound_scene()
    assert bounds.qo_indptr.tolist() == [0, 5, 6, 14, 16]
    assert bounds.kv_lens.tolist() == [10, 1, 19, 5] and bounds.kv_indptr[-1] == 35
    out = fp.fa2_paged_prefill_reference(padded(q, bounds.total_rows), kc, vc, plan, bounds,
                                         D**-0.5)  # fmt: skip
    rows = fp.padded_rows(plan.qo_indptr, bounds.qo_indptr, q.shape[0])
    assert rows.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 14, 15]
    torch.testing.assert_close(out[rows], want)


def test_outputs_read_at_the_packed_offsets_are_wrong():
    """Control: with bounds above the lengths the kernel's outputs sit at the bound offsets;
    reading them where the queries were (what a plan-agnostic caller does) is wrong."""
    plan, bounds, q, kc, vc, want = bound_scene()
    out = fp.fa2_paged_prefill_reference(padded(q, bounds.total_rows), kc, vc, plan, bounds,
                                         D**-0.5)  # fmt: skip
    assert not torch.allclose(out[: q.shape[0]], want)
    off = fp.padded_rows(plan.qo_indptr, bounds.qo_indptr + 1, q.shape[0]).clamp(max=15)
    assert not torch.allclose(out[off], want)  # an off-by-one in the bound offsets


def test_padding_rows_past_the_batch_map_to_row_zero():
    plan, bounds, *_ = bound_scene()
    rows = fp.padded_rows(plan.qo_indptr, bounds.qo_indptr, 16)  # a 16-token bucket
    assert rows[12:].tolist() == [0, 0, 0, 0]


class Fa2Wrapper:
    """FlashInfer's paged-prefill wrapper reduced to its fa2 addressing (the reference)."""

    def __init__(self, plan, bounds, kc, vc):
        self.plan, self.bounds, self.kc, self.vc = plan, bounds, kc, vc

    def forward(self, q, kv_cache, sm_scale, **kwargs):
        assert q.shape[0] == self.bounds.total_rows  # FlashInfer checks q against the plan
        return fp.fa2_paged_prefill_reference(q, self.kc, self.vc, self.plan, self.bounds,
                                              sm_scale)  # fmt: skip


def test_the_backend_wrapper_pads_the_queries_and_maps_the_outputs_back():
    plan, bounds, q, kc, vc, want = bound_scene()
    wrapper = BoundsOutputWrapper(Fa2Wrapper(plan, bounds, kc, vc), plan.qo_indptr, bounds,
                                  total=q.shape[0])  # fmt: skip
    bucket = torch.cat([q, torch.randn(4, HQ, D)])  # graph-bucket padding rows after the batch
    out = wrapper.forward(bucket, None, sm_scale=D**-0.5)
    assert out.shape == bucket.shape
    torch.testing.assert_close(out[: q.shape[0]], want)


def test_bounds_come_from_the_layout_and_the_batch_host_lengths():
    from types import SimpleNamespace

    fb = SimpleNamespace(seq_lens_cpu=torch.tensor([10, 1, 19, 5]),
                         spec_info=SimpleNamespace(draft_token_num=16))  # fmt: skip
    layout = SimpleNamespace(qo_indptr_host=torch.tensor([0, 5, 6, 14, 16], dtype=torch.int32))
    b = layout_bounds(layout, fb)
    assert b.qo_indptr.tolist() == [0, 5, 6, 14, 16] and b.kv_lens.tolist() == [10, 1, 19, 5]
    uniform = layout_bounds(SimpleNamespace(qo_indptr_host=None), fb)  # DFlash's own batch
    assert uniform.qo_indptr.tolist() == [0, 16, 32, 48, 64]
    assert layout_bounds(layout, SimpleNamespace(seq_lens_cpu=None)) is None


@pytest.mark.gpu
def test_flashinfer_kernel_planned_from_host_bounds():
    """FlashInfer's own fa2 kernel, planned from the bounds (CPU arrays) and run on the exact
    device arrays, writes each request's outputs at its bound offset."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (FlashInfer has no CPU kernels)")
    flashinfer = pytest.importorskip("flashinfer")
    plan, bounds, q, kc, vc, want = bound_scene()
    dev = torch.device("cuda")
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    w.plan(bounds.qo_indptr, bounds.kv_indptr, plan.kv_indices.to(dev),
           torch.ones_like(bounds.kv_lens), HQ, HKV, D, 1, causal=True,
           q_data_type=torch.float16)  # fmt: skip
    w._qo_indptr_buf = plan.qo_indptr.to(dev)
    w._paged_kv_indptr_buf = plan.kv_indptr.to(dev)
    w._paged_kv_last_page_len_buf = plan.kv_last_page_len.to(dev)
    wrapper = BoundsOutputWrapper(w, plan.qo_indptr.to(dev), bounds, total=q.shape[0])
    out = wrapper.forward(q.half().to(dev), (kc.half().to(dev), vc.half().to(dev)),
                          causal=True, sm_scale=D**-0.5)  # fmt: skip
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.sglang
def test_the_backend_plans_from_bounds_and_runs_on_the_exact_arrays():
    """RaggedVerifyFlashInferBackend.init_forward_metadata on a ragged verify: SGLang's own
    metadata path builds the exact arrays and calls the wrapper's plan; the plugin's plan gets
    host bounds (CPU tensors), the wrapper then holds the exact arrays, forward_extend gets the
    remapping wrapper, and the wrapper's own plan is back in place afterwards."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from sglang_adaflash.sglang_plugin.flashinfer_verify import flashinfer_backend_class

    plan, bounds, *_ = bound_scene()

    class Wrapper:
        _backend = "fa2"
        planned: list = []

        def plan(self, qo, kv, indices, last, *args, **kwargs):
            type(self).planned.append((qo, kv, last, args, kwargs))

        begin_forward = plan

    class Updater:  # what SGLang's FlashInferIndicesUpdaterPrefill hands the wrapper
        def update(self, *args, prefill_wrappers, **kwargs):
            prefill_wrappers[0].begin_forward(plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                              plan.kv_last_page_len, 4, 2, 8, 1,
                                              q_data_type=torch.float16)  # fmt: skip

    cls = flashinfer_backend_class()
    backend = cls.__new__(cls)
    wrapper = Wrapper()
    backend.__dict__.update(use_sliding_window_kv_pool=False, num_wrappers=1,
                            prefill_wrappers_verify=[wrapper], indices_updater_prefill=Updater())  # fmt: skip
    layout = SimpleNamespace(qo_indptr_host=bounds.qo_indptr, total_verify_tokens=12)
    mode = SimpleNamespace(is_decode_or_idle=lambda: False, is_target_verify=lambda: True)
    fb = SimpleNamespace(forward_mode=mode, spec_info=SimpleNamespace(ragged_verify_layout=layout),
                         seq_lens_cpu=bounds.kv_lens, req_pool_indices=None, seq_lens=None,
                         seq_lens_sum=0, encoder_lens=None, kv_loc_plan=None)  # fmt: skip
    backend.init_forward_metadata(fb)
    ((qo, kv, last, args, kwargs),) = Wrapper.planned
    assert qo.device.type == kv.device.type == "cpu"  # what FlashInfer reads on the host
    assert qo.tolist() == bounds.qo_indptr.tolist() and kv.tolist() == bounds.kv_indptr.tolist()
    assert args == (4, 2, 8, 1) and kwargs == {"q_data_type": torch.float16}
    assert wrapper._qo_indptr_buf is plan.qo_indptr and wrapper._paged_kv_indptr_buf is plan.kv_indptr
    assert "begin_forward" not in wrapper.__dict__
    (used,) = backend.forward_metadata.prefill_wrappers
    assert isinstance(used, BoundsOutputWrapper) and used._rows == 16 and used._total == 12
