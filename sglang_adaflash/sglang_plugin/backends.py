"""Ragged (compact) target verification on SGLang's Triton and FlashInfer attention backends,
as subclasses the plugin registers in place of SGLang's own, with no fork.

SGLang 0.5.23 verifies a ``RaggedVerifyLayout`` (per-request verify lengths, packed) only on
FA3/FA4, TRT-LLM and DSv4. Its Triton backend builds the verify's query offsets as a uniform
``arange(0, (bs+1)*B, B)``, whatever the layout says, and its FlashInfer backend plans a
layout with a host read of its offsets (and refuses one inside CUDA graphs). Both already take
per-request query lengths for prefill, which is all a ragged verify is:

- :class:`RaggedVerifyTritonBackend`: the layout's ``qo_indptr`` (padded to the captured slots
  on graph replay) in eager metadata and in the graph buffers; the extend kernel reads the
  prefix through ``kv_indptr`` (committed lengths) and the packed verify rows as the causal
  extend part, so nothing else changes. ``max_extend_len`` stays B, an upper bound the kernel
  grid takes; the split-KV verify fast paths (ROCm) are off, as they assume uniform rows.
- ``RaggedVerifyFlashInferBackend`` (:mod:`.flashinfer_verify`): plans from host bounds and
  runs on the exact device arrays, eagerly (no CUDA graphs for the verify yet). Only with an
  explicit ``ADAFLASH_VERIFY_MODE=compact``; ``auto`` keeps fixed on FlashInfer.

The subclasses are registered under the stock names by :func:`install_ragged_backends`, only
in processes where ADAFLASH resolved the compact verify mode and only for the target's model
runner (non-MLA), so every other launch and the drafter build SGLang's classes untouched.
"""

from __future__ import annotations

import logging

from .options import VERIFY_COMPACT, resolved_verify_mode

logger = logging.getLogger(__name__)

#: Backends this module teaches ragged verification, by SGLang's registry name.
EXTENDED_BACKENDS = ("triton", "flashinfer")


def _layout(forward_batch_or_spec):
    spec = getattr(forward_batch_or_spec, "spec_info", forward_batch_or_spec)
    return getattr(spec, "ragged_verify_layout", None) if spec is not None else None


def ragged_qo_indptr(layout, bs: int):
    """The layout's query offsets for ``bs`` rows (the captured slots on graph replay)."""
    if layout.bs != bs:
        layout = layout.padded_to_bucket(padded_bs=bs)
    return layout.qo_indptr_device


def triton_backend_class():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    class RaggedVerifyTritonBackend(TritonAttnBackend):
        """SGLang's Triton attention with ragged target verification (module docstring)."""

        supports_ragged_verify_graph = True

        def __init__(self, model_runner, *args, **kwargs):
            super().__init__(model_runner, *args, **kwargs)
            # Their can_handle() gates ignore ragged rows: keep the plain extend kernel.
            self.use_verify_splitkv = False
            self.use_verify_shared_kv = False

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            layout = _layout(forward_batch)
            if layout is not None and forward_batch.forward_mode.is_target_verify():
                self.forward_metadata.qo_indptr = ragged_qo_indptr(layout, forward_batch.batch_size)

        def _update_target_verify_buffers(self, plan, bs, seq_lens, spec_info, req_pool_indices):
            out = super()._update_target_verify_buffers(
                plan, bs, seq_lens, spec_info, req_pool_indices
            )
            layout = _layout(spec_info)
            if layout is not None:
                out[0].copy_(ragged_qo_indptr(layout, bs))  # the graph's qo_indptr buffer
            return out

    return RaggedVerifyTritonBackend


def install_ragged_backends() -> list[str]:
    """Register the ragged-verify subclasses under SGLang's names when ADAFLASH runs compact
    (idempotent); returns the names replaced."""
    if resolved_verify_mode() != VERIFY_COMPACT:
        return []
    from sglang.srt.layers.attention import attention_registry as reg

    from .flashinfer_verify import flashinfer_backend_class

    def triton_for(runner):
        if runner.model_config.is_encoder_decoder:
            return None
        return triton_backend_class()(runner)

    def flashinfer_for(runner):
        if runner.use_mla_backend or runner.is_draft_worker:
            return None  # MLA: flashinfer_mla has its own ragged path; the drafter: no verify
        return flashinfer_backend_class()(runner, init_new_workspace=runner.init_new_workspace)

    replaced = []
    for name, build in (("triton", triton_for), ("flashinfer", flashinfer_for)):
        stock = reg.ATTENTION_BACKENDS.get(name)
        if stock is None or getattr(stock, "_adaflash", False):
            continue

        def create(runner, _stock=stock, _build=build):
            backend = _build(runner)
            return _stock(runner) if backend is None else backend

        create._adaflash = True
        reg.ATTENTION_BACKENDS[name] = create
        replaced.append(name)
    if replaced:
        logger.info("ADAFLASH: ragged verify on SGLang's %s backends", ", ".join(replaced))
    return replaced
