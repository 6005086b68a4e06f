"""Compact verification in SGLang's DFlash V2 step: the target's verify forward on the
chosen verify lengths, packed, with its outputs scattered back to DFlash's strided layout.

A mixin of AdaFlashWorkerV2 (sglang_plugin.worker), joined at the verify seam: the worker's
``target_worker`` answers with :class:`CompactVerifyTarget` during a compact step, whose verify
call lands in :meth:`CompactVerify._compact_verify`. That rebuilds the verify batch packed to
the plan's lengths (SGLang's ``BuildRaggedVerifyWindow`` and ``DFlashVerifyInput`` with a
``ragged_verify_layout``), runs the target on ``sum(L)`` tokens (inside a captured bucket where
one fits), and scatters the hidden states, and the logits or only their argmax, back to the
``[bs*B]`` layout the rest of DFlash's step reads. It reads the worker's step state
(``_ada_step``), ``block_size``, ``device``, ``_target_logits_processor`` and DFlash's
``_can_skip_verify_logits``.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput

from . import length_budget as lb


class _NoMetadataBackend:
    """The target's attention backend, minus metadata planning (see _FullWidthPrepRunner)."""

    def __init__(self, backend):
        self._backend = backend

    def init_forward_metadata(self, forward_batch) -> None:
        return None

    def __getattr__(self, name):
        return getattr(self._backend, name)


class _FullWidthPrepRunner:
    """The target's model runner as DFlash's full-width verify preparation sees it in compact
    mode. That batch is never run (the compact one replaces it), so loading it into a CUDA graph
    or planning its attention metadata would be work thrown away every step."""

    decode_cuda_graph_runner = None

    def __init__(self, runner):
        self._runner = runner

    @property
    def attn_backend(self):
        return _NoMetadataBackend(self._runner.attn_backend)

    def __getattr__(self, name):
        return getattr(self._runner, name)


class CompactVerifyTarget:
    """Forwards everything to the target worker, except that verify forwards run compact.

    A step whose plan is whole blocks (a sampled batch, no head output) and whose batch fits a
    captured bucket as it is needs nothing compact: DFlash's own full-width verify batch is
    that bucket's layout already, so it runs as DFlash prepared it, with the uniform layout
    attached (compact-mode graphs replay only batches that carry one). No second batch, no
    window, no scatter.
    """

    def __init__(self, real, worker):
        self._real = real
        self._worker = worker

    @property
    def model_runner(self):
        step = self._worker._ada_step
        if step.passthrough:
            # prepare_for_verify reads this while building the verify ForwardBatch, after it
            # made the verify input the batch's spec_info: the layout rides along from here.
            spec = step.batch.spec_info
            if isinstance(spec, DFlashVerifyInput) and spec.ragged_verify_layout is None:
                spec.ragged_verify_layout = self._worker._ada_uniform_layout(len(step.batch.seq_lens))
            return self._real.model_runner
        return _FullWidthPrepRunner(self._real.model_runner)

    def forward_batch_generation(self, *args, **kwargs):
        forward_batch = kwargs.get("forward_batch")
        if not kwargs.get("is_verify") or forward_batch is None or self._worker._ada_step.passthrough:
            return self._real.forward_batch_generation(*args, **kwargs)
        return self._worker._compact_verify(self._real, forward_batch, kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)



class CompactVerify:
    """The worker's compact verify forward and the buffers and reads it needs (see the module)."""

    def _compact_verify(self, real_target, full_forward_batch, kwargs):
        """Run the verify forward on the packed verify lengths; return strided outputs."""
        from sglang.kernels.ops.speculative.dspark.dspark_verify_window import (
            BuildRaggedVerifyWindow,
        )

        step = self._ada_step
        block = int(self.block_size)
        batch = step.batch
        bs = len(batch.seq_lens)
        plan, budget = step.plan, step.budget
        if budget is None or plan.is_uniform:  # whole blocks that fit no bucket as they are
            budget = lb.plan_host_budget(
                block_size=block, min_len=block, remaining=None, bs=bs, mean_len=block,
                grid=lb.capture_grid(real_target.model_runner)[0],
            )  # fmt: skip
        total = plan.total_host if plan.total_host is not None else budget.total
        layout = lb.verify_layout(
            plan.lengths, total=total, graph_num_tokens=max(budget.graph_num_tokens, total),
            caps=budget.cap,
        )  # fmt: skip
        full_input = full_forward_batch.spec_info
        draft_tokens = full_input.draft_token.view(bs, block)  # [bs, B], slot 0 = anchor
        gamma = block - 1
        window = BuildRaggedVerifyWindow.execute(
            batch=batch,
            layout=layout,
            # Both views must be gamma wide: the Triton path reads request i's anchor at
            # i * gamma of the (made contiguous) block ids, the torch path reads column 0.
            draft_block_ids=draft_tokens[:, :gamma],
            draft_tokens=draft_tokens[:, 1:],
            bs=bs,
            device=self.device,
            verify_num_draft_tokens=block,
            model_runner=real_target.model_runner,
        )
        compact_input = DFlashVerifyInput(
            draft_token=window.verify_ids,
            positions=window.positions,
            draft_token_num=block,
            custom_mask=None,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            ragged_verify_layout=layout,
            live_seq_lens_cpu=batch.seq_lens_cpu,
            kv_loc_plan=full_input.kv_loc_plan,
            kv_loc_cols=window.window_index,  # the packed rows select from the planned window
        )
        saved = (
            batch.out_cache_loc,
            batch.input_ids,
            batch.spec_info,
            batch.seq_lens_cpu,
            batch.seq_lens_sum,
        )
        batch.out_cache_loc = window.verify_cache_loc
        if batch.seq_lens_cpu is not None:
            # Verify host bound = committed prefix + the most this request may verify (as
            # DFlash's own bound is prefix + B); the exact lengths stay on the device.
            batch.seq_lens_cpu = batch.seq_lens_cpu + torch.tensor(
                budget.cap, dtype=batch.seq_lens_cpu.dtype
            )
            batch.seq_lens_sum = batch.seq_lens_sum + sum(budget.cap)
        try:
            compact_batch, _ = compact_input.prepare_for_verify(batch, real_target)
        finally:
            (
                batch.out_cache_loc,
                batch.input_ids,
                batch.spec_info,
                batch.seq_lens_cpu,
                batch.seq_lens_sum,
            ) = saved
        kwargs = dict(kwargs, forward_batch=compact_batch, skip_attn_backend_init=True)
        out = real_target.forward_batch_generation(**kwargs)
        logits_output = out.logits_output
        packed = logits_output.next_token_logits  # [T_graph, V] (a vocab shard under TP gather)
        if self._ada_argmax_only(batch):
            step.target_predict = self._ada_strided_argmax(packed, layout, block)
            logits_output.next_token_logits = lb.no_logits(bs * block, self._ada_vocab(packed), packed)
        else:
            logits_output.next_token_logits = lb.scatter_to_strided(
                packed, layout, block, out=self._ada_scatter_out("logits")
            )
        if logits_output.hidden_states is not None:
            logits_output.hidden_states = lb.scatter_to_strided(
                logits_output.hidden_states, layout, block, out=self._ada_scatter_out("hidden")
            )
        return out

    def _ada_argmax_only(self, batch) -> bool:
        """A greedy step whose acceptance needs nothing of the logits but their argmax: no
        grammar, logprobs, penalties, logit bias or custom processor (DFlash's own test for
        skipping its verify logits). Host values only."""
        step = self._ada_step
        return step.greedy and self._can_skip_verify_logits(batch, batch.sampling_info)

    def _ada_vocab(self, packed) -> int:
        lp = self.__dict__.get("_target_logits_processor")
        return int(lp.vocab_size) if lp is not None else int(packed.shape[-1])

    def _ada_strided_argmax(self, packed, layout, block: int):
        """The target's greedy token of each packed row, scattered to the strided [bs*B]
        layout DFlash's acceptance reads (unverified slots hold 0; acceptance never reaches
        them, see length_budget.cap_candidates)."""
        lp = self.__dict__.get("_target_logits_processor")
        if lp is not None and lp.is_deferred_shard(packed):
            top1 = lp.deferred_argmax(packed)  # gathers row maxima across the TP group
        else:
            top1 = torch.argmax(packed, dim=-1)
        strided = lb.scatter_to_strided(
            top1.view(-1, 1), layout, block, out=self._ada_scatter_out("predict")
        )
        return strided.view(-1)

    def _ada_scatter_out(self, kind: str) -> lb.ScatterBuffer:
        """One buffer per kind is enough: every reader of a step's strided logits and hidden
        states runs inside that step, on the forward stream (the scheduler only drops them)."""
        buffers = self.__dict__.setdefault("_ada_scatter_buffers", {})
        if kind not in buffers:
            buffers[kind] = lb.ScatterBuffer()
        return buffers[kind]
