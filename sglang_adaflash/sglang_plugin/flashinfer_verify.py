"""Compact (ragged) target verification on SGLang's FlashInfer backend, planned from host
bounds so that no decode step reads the verify lengths back (``flashinfer_plan`` has the
argument; this module wires it into SGLang 0.5.23's ``FlashInferAttnBackend``).

SGLang's own FlashInfer verify plans with device arrays: ``plan()`` copies ``qo_indptr`` and
``kv_indptr`` to the host, a sync per step, and its CUDA-graph replay path refuses a ragged
layout. The subclass here, for a target-verify batch with a ``RaggedVerifyLayout``:

1. lets SGLang build the exact device arrays as it always does (``DFlashVerifyInput.
   generate_attn_arg_prefill``: the layout's ``qo_indptr``, ``kv_indptr`` over prefix + L);
2. intercepts the wrapper's ``plan`` call: plans with the host bounds (``cap_i`` verify rows,
   ``prefix_i + cap_i`` KV tokens: ``forward_batch.seq_lens_cpu``, which the worker sets to
   exactly that), then points the wrapper's device buffers at the exact arrays;
3. hands ``forward_extend`` a wrapper that pads the packed queries to the bound plan's rows and
   maps the outputs, written at the bound offsets, back to the packed rows.

The verify forward runs eagerly (``supports_ragged_verify_graph`` is False, so SGLang's graph
runner does not try to replay it): replaying it inside CUDA graphs needs the same bounds in
SGLang's graph wrappers, with fixed row counts per captured bucket, and is not built
(docs/sglang.md). Only full-attention models with one wrapper (no sliding window, no
cross-attention) and FlashInfer's fa2 prefill, whose kernel reads the query offsets and
lengths from the device arrays, are served; anything else raises with the fix.
"""

from __future__ import annotations

import torch

from .flashinfer_plan import HostBounds, host_bounds, padded_rows


def layout_bounds(layout, forward_batch) -> HostBounds | None:
    """Host bounds of a ragged verify: caps from the layout's host ``qo_indptr`` when the
    plugin set one (compact batches), else whole blocks (DFlash's own verify batch); KV bounds
    from ``seq_lens_cpu`` (committed prefix + cap). None when the host has no lengths."""
    kv = getattr(forward_batch, "seq_lens_cpu", None)
    if kv is None:
        return None
    host_qo = getattr(layout, "qo_indptr_host", None)
    if host_qo is not None:
        caps = (host_qo[1:] - host_qo[:-1]).tolist()  # a CPU tensor: no device read
    else:
        caps = [int(forward_batch.spec_info.draft_token_num)] * len(kv)
    return host_bounds(caps, kv)


class BoundsOutputWrapper:
    """The verify's paged-prefill wrapper as SGLang's ``forward_extend`` calls it."""

    def __init__(self, wrapper, qo_indptr: torch.Tensor, bounds: HostBounds, total: int):
        self._wrapper = wrapper
        self._qo_indptr = qo_indptr  # [bs+1] exact, on the device
        self._bound_qo_indptr = bounds.qo_indptr.to(qo_indptr.device, non_blocking=True)
        self._rows = bounds.total_rows
        self._total = total  # packed rows that belong to requests (host int)

    def forward(self, q: torch.Tensor, kv_cache, **kwargs) -> torch.Tensor:
        n = min(self._total, q.shape[0])
        q_pad = q.new_zeros((self._rows, *q.shape[1:]))  # [sum(cap), Hq, D]
        q_pad[:n] = q[:n]
        out = self._wrapper.forward(q_pad, kv_cache, **kwargs)  # rows at the bound offsets
        return out[padded_rows(self._qo_indptr, self._bound_qo_indptr, q.shape[0])]

    def __getattr__(self, name):
        return getattr(self._wrapper, name)


def flashinfer_backend_class():
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    class RaggedVerifyFlashInferBackend(FlashInferAttnBackend):
        """SGLang's FlashInfer attention with an eager ragged target verify (module docstring)."""

        supports_ragged_verify = True
        supports_ragged_verify_graph = False

        def init_forward_metadata(self, forward_batch):
            layout = _layout(forward_batch)
            if layout is None or not forward_batch.forward_mode.is_target_verify():
                return super().init_forward_metadata(forward_batch)
            bounds = layout_bounds(layout, forward_batch)
            if bounds is None:
                raise RuntimeError("ADAFLASH ragged verify on FlashInfer needs the verify "
                                   "batch's host lengths (seq_lens_cpu)")  # fmt: skip
            if self.num_wrappers != 1:
                raise NotImplementedError(
                    "ADAFLASH compact verification on FlashInfer serves full-attention models "
                    "only (this one has sliding-window or cross-attention layers); set "
                    "ADAFLASH_VERIFY_MODE=fixed or use --attention-backend fa3 or triton"
                )
            wrapper = self.prefill_wrappers_verify[0]
            if getattr(wrapper, "_backend", "fa2") != "fa2":
                raise NotImplementedError(
                    f"ADAFLASH compact verification on FlashInfer needs its fa2 prefill "
                    f"kernel, found {wrapper._backend!r}; set ADAFLASH_VERIFY_MODE=fixed"
                )
            exact: dict = {}
            stock_plan = wrapper.__dict__.get("begin_forward")

            def plan_from_bounds(qo_indptr, kv_indptr, kv_indices, last_page_len, *a, **kw):
                # FlashInfer reads these four on the host: give it the bounds (CPU tensors,
                # nothing waits for the device), then the kernel the exact device arrays.
                type(wrapper).plan(wrapper, bounds.qo_indptr, bounds.kv_indptr, kv_indices,
                                   torch.ones_like(bounds.kv_lens), *a, **kw)  # fmt: skip
                wrapper._qo_indptr_buf = qo_indptr
                wrapper._paged_kv_indptr_buf = kv_indptr
                wrapper._paged_kv_last_page_len_buf = last_page_len
                exact["qo_indptr"] = qo_indptr

            wrapper.begin_forward = plan_from_bounds
            try:
                super().init_forward_metadata(forward_batch)
            finally:
                if stock_plan is None:
                    del wrapper.begin_forward
                else:
                    wrapper.begin_forward = stock_plan
            total = layout.total_verify_tokens or int(bounds.total_rows)
            self.forward_metadata.prefill_wrappers = [
                BoundsOutputWrapper(wrapper, exact["qo_indptr"], bounds, total)
            ]

    return RaggedVerifyFlashInferBackend


def _layout(forward_batch):
    spec = getattr(forward_batch, "spec_info", None)
    return getattr(spec, "ragged_verify_layout", None) if spec is not None else None
