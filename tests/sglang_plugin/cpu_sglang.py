"""SGLang 0.5.23's own scheduler, model runners and the ADAFLASH worker, serving the embedded
model pair on CPU, for the tests in ``test_sglang_cpu_engine.py``.

Run it in a fresh process (``python -m tests.sglang_plugin.cpu_sglang --out DIR ...``): Triton
reads ``TRITON_INTERPRET=1`` when SGLang defines its kernels, and the seams below change
process-wide state. It writes ``DIR/summary.json`` (construction, outputs, kernels launched)
and ``DIR/steps.pt`` (what each decode step's verification saw and decided).

Nothing of SGLang's is rebuilt here: ``Scheduler.__init__`` builds the target and draft model
runners, then SGLang's ``create_worker`` builds ``AdaFlashWorkerV2``, then the memory pools,
then the attention backends, in SGLang's order. Only pieces that exist for CUDA alone are
swapped, each at the lowest point where it can be:

- the device: ``get_device().override(device="cpu")``, SGLang's own test injection (argument
  resolution still says ``cuda``, because SGLang refuses DFLASH on a CPU platform);
- the target's and the draft's attention kernels: the ``fa3`` entry of SGLang's attention
  registry (FlashAttention 3 is CUDA-only) builds :class:`CpuRaggedVerifyBackend`, SGLang's
  torch-native backend plus the verify forward, ragged layouts included, that FA3 provides;
- ``Tensor.record_stream`` on CPU tensors (a CUDA stream API) does nothing;
- the rotary embedding takes SGLang's CPU branch at construction (the other branch imports a
  CUDA extension), and speculative cache-location assignment takes SGLang's Triton kernel
  (interpreted) instead of its CPU extension, which is not installed;
- the draft attention's fused q/k-norm + rope Triton kernel is switched off per layer (it is
  correct interpreted but takes seconds a step; the unfused path is SGLang's own).

``--dispatch triton`` also routes SGLang's ragged-verify kernels (``inputs_on_cuda``) and the
DFlash worker's own Triton switches to the Triton kernels, interpreted; ``--dispatch torch``
leaves SGLang's CPU dispatch (its torch reference implementations) alone.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import sys
import time
import traceback
from collections import defaultdict, deque
from pathlib import Path

import torch

from tests.sglang_plugin.triton_interpreter import fix_bf16_dot

HERE = Path(__file__).resolve()
_DEVICE_OVERRIDE = None
PLUGIN_DIR = HERE.parents[2] / "sglang_adaflash" / "sglang_plugin"


# ---------------------------------------------------------------------------------------------
# The CPU stand-in for FlashAttention 3
# ---------------------------------------------------------------------------------------------


def _ragged_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class CpuRaggedVerifyBackend(TorchNativeAttnBackend):
        """Torch-native attention plus TARGET_VERIFY, with the per-request query lengths of a
        ragged layout as FA3 reads them (the torch-native backend has no verify path)."""

        supports_ragged_verify_graph = True
        metadata_calls: list[tuple[str, int, int]] = []

        def __init__(self, model_runner):
            super().__init__(model_runner)
            self.role = "draft" if model_runner.is_draft_worker else "target"

        def init_forward_metadata(self, forward_batch):
            tokens = 0 if forward_batch.input_ids is None else int(forward_batch.input_ids.numel())
            type(self).metadata_calls.append(
                (self.role, forward_batch.forward_mode.name, forward_batch.batch_size, tokens)
            )
            return super().init_forward_metadata(forward_batch)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            spec = forward_batch.spec_info
            bs = forward_batch.batch_size
            layout = getattr(spec, "ragged_verify_layout", None)
            if layout is not None:
                qlens = layout.verify_lens.to(torch.int64)[:bs]
            else:
                qlens = torch.full((bs,), int(spec.draft_token_num), dtype=torch.int64)
            prefix = forward_batch.seq_lens.to(torch.int64)
            total = int(qlens.sum())
            o = q.new_zeros((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
            if save_kv_cache:
                self.token_to_kv_pool.set_kv_buffer(
                    layer,
                    KVWriteLoc(forward_batch.out_cache_loc[:total], None),
                    k[:total],
                    v[:total],
                )
            self._run_sdpa_forward_extend(
                q[:total].reshape(total, layer.tp_q_head_num, layer.qk_head_dim),
                o[:total].view(total, layer.tp_q_head_num, layer.v_head_dim),
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                prefix + qlens,
                prefix,
                qlens,
                scaling=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
                causal=layer.attn_type != AttentionType.ENCODER_ONLY,
            )
            return o

    return CpuRaggedVerifyBackend


# ---------------------------------------------------------------------------------------------
# Seams and instrumentation
# ---------------------------------------------------------------------------------------------


class Kernels:
    """Which interpreted Triton kernels ran, and which plugin function was on the stack."""

    def __init__(self):
        self.callers: dict[str, set[str]] = defaultdict(set)
        self.enabled = False

    def install(self):
        from triton.runtime import interpreter

        original = interpreter.InterpretedFunction.run
        kernels = self

        def run(self, *args, **kwargs):
            if kernels.enabled:
                kernels.callers[f"{self.fn.__module__}.{self.fn.__name__}"].add(_plugin_caller())
            return original(self, *args, **kwargs)

        interpreter.InterpretedFunction.run = run


def _plugin_caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.parent == PLUGIN_DIR:
            return f"{path.stem}.{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "(SGLang's DFlash step)"


def install_seams(dispatch: str):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (read when SGLang defines its kernels)")
    record_stream = torch.Tensor.record_stream

    def record_stream_cpu(self, stream):
        if self.is_cuda:
            return record_stream(self, stream)
        return None

    torch.Tensor.record_stream = record_stream_cpu
    # Interpreted tl.dot multiplies bfloat16 bit patterns (triton_interpreter.py): without
    # this, SGLang's Triton attention on the bfloat16 embedded pair is meaningless.
    fix_bf16_dot()

    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.srt.layers.rotary_embedding.base as rotary
    from sglang.srt.layers.attention import attention_registry

    rotary._is_cpu = True
    cache_locs._is_cuda = True
    backend = _ragged_backend_class()
    attention_registry.ATTENTION_BACKENDS["fa3"] = backend
    if dispatch == "triton":
        from sglang.kernels.ops.speculative.dspark import dspark_verify_window

        dspark_verify_window.inputs_on_cuda = lambda *args, **kwargs: True
    return backend


# ---------------------------------------------------------------------------------------------
# Building SGLang's scheduler
# ---------------------------------------------------------------------------------------------


def server_args(opts: argparse.Namespace, work: Path):
    """SGLang's arguments for a run; ``opts``: the harness's parsed command line."""
    from sglang.srt.server_args import prepare_server_args

    from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR

    os.environ.update(
        ADAFLASH_VERIFY_MODE=opts.mode,
        ADAFLASH_HOME=str(work / "home"),
        ADAFLASH_FLEET_VERSION_FILE=str(work / "fleet-version"),
        ADAFLASH_LOADED_VERSION_FILE=str(work / "loaded.json"),
        ADAFLASH_ADMIN_OVERRIDE_FILE=str(work / "override"),
        ADAFLASH_RELOAD_POLL_S="3600",  # polled by hand below
        ADAFLASH_RELOAD_SYNC_STEPS="1",
        ADAFLASH_METRICS="0",
    )
    args = prepare_server_args(
        [
            "--model-path", str(TARGET_DIR),
            "--speculative-algorithm", "ADAFLASH",
            "--speculative-draft-model-path", str(DRAFTER_DIR),
            "--device", "cuda",
            "--attention-backend", opts.attention,
            "--speculative-draft-attention-backend", opts.draft_attention,
            "--cuda-graph-backend-decode", "disabled",
            "--cuda-graph-backend-prefill", "disabled",
            "--skip-tokenizer-init",
            "--max-total-tokens", "4096",
            "--mem-fraction-static", "0.1",
            "--random-seed", "0",
            "--dtype", opts.dtype,
            *([] if opts.overlap else ["--disable-overlap-schedule"]),
            *([] if opts.radix else ["--disable-radix-cache"]),
        ]
    )  # fmt: skip
    args.resolve_once()
    return args


def build_scheduler(opts: argparse.Namespace, work: Path, order: list[str]):
    """SGLang's Scheduler, built as its scheduler process builds it; ``order`` records when the
    worker and the attention backends came to exist."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish
    from sglang.srt.server_args import PortArgs

    from sglang_adaflash.sglang_plugin import register
    from sglang_adaflash.sglang_plugin.worker import AdaFlashWorkerV2

    register()
    args = server_args(opts, work)
    port_args = PortArgs.init_new(args)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    global _DEVICE_OVERRIDE  # held for the rest of this process
    _DEVICE_OVERRIDE = get_device().override(device="cpu")
    _DEVICE_OVERRIDE.__enter__()

    init_backends = TpModelWorker.init_attention_backends
    worker_init = AdaFlashWorkerV2.__init__

    def tp_init_backends(self):
        order.append("draft backends" if self.is_draft_worker else "target backends")
        return init_backends(self)

    def ada_init(self, *a, **k):
        order.append("AdaFlashWorkerV2.__init__ begins")
        worker_init(self, *a, **k)
        order.append("AdaFlashWorkerV2.__init__ ends")

    TpModelWorker.init_attention_backends = tp_init_backends
    AdaFlashWorkerV2.__init__ = ada_init
    try:
        scheduler = Scheduler(args, port_args)
    finally:
        TpModelWorker.init_attention_backends = init_backends
        AdaFlashWorkerV2.__init__ = worker_init
    return scheduler


# ---------------------------------------------------------------------------------------------
# Driving it
# ---------------------------------------------------------------------------------------------


def prompts(max_tokens: int = 160) -> list[list[int]]:
    """Token ids of two held-out prompts per embedded domain, the last ``max_tokens`` of each."""
    from transformers import PreTrainedTokenizerFast

    from sglang_adaflash.assets import DOMAINS, TARGET_DIR, workload_path
    from sglang_adaflash.assets.chat_format import render_prompt

    tok = PreTrainedTokenizerFast(tokenizer_file=str(TARGET_DIR / "tokenizer.json"))
    out = []
    for domain in DOMAINS:
        with open(workload_path(domain)) as f:
            for line, _ in zip(f, range(2)):
                out.append(tok.encode(render_prompt(json.loads(line)["prompt"]))[-max_tokens:])
    return out


def submit(scheduler, rid: str, input_ids: list[int], temperature: float, max_new: int):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_new_tokens=max_new, ignore_eos=True)
    params.normalize(None)
    scheduler.handle_generate_request(
        TokenizedGenerateReqInput(
            rid=rid,
            input_text=None,
            input_ids=array.array("q", input_ids),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
        )
    )


def run_to_completion(
    scheduler, on_step=None, max_iters=200, cached: dict | None = None
) -> dict[str, list[int]]:
    """Drive SGLang's scheduler as its own event loop does (``event_loop_normal``, or
    ``event_loop_overlap`` when overlap scheduling is on: launch a batch, then process the
    previous batch's result while it runs), with requests submitted directly instead of over
    ZMQ. Returns the finished requests' outputs by rid; ``cached`` gets each one's prompt
    tokens served from the radix cache."""
    done: dict[str, list[int]] = {}
    queue: deque = deque()
    scheduler.result_queue = queue  # event_loop_overlap's attribute, read by SGLang's helpers
    # run_event_loop sets this before dispatching: off unless CUDA (no shared-read fence)
    scheduler.__dict__.setdefault("_war_barrier_enabled", False)
    overlap = scheduler.enable_overlap
    if overlap:
        scheduler.enable_skip_finishing_decode = True

    def process(batch, result):
        scheduler.process_batch_result(batch, result)
        for req in batch.reqs:
            if req.finished():
                # what a client receives: speculative steps may commit past max_new_tokens
                done[req.rid] = list(req.output_ids_through_stop)
                if cached is not None:
                    cached[req.rid] = int(req.cached_tokens)

    for _ in range(max_iters):
        plan = scheduler.get_next_batch_to_run(
            running_batch=scheduler.running_batch, last_batch=scheduler.last_batch
        )
        scheduler.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if not overlap:
            if not batch:
                return done
            if on_step is not None:
                on_step(batch)
            process(batch, scheduler.run_batch(batch))
            scheduler.last_batch = batch
            continue
        serial = scheduler.is_disable_overlap_for_batch(batch, last_batch=scheduler.last_batch)
        if serial and queue:
            process(*queue.popleft())
        result = None
        if batch:
            if on_step is not None:
                on_step(batch)
            result = scheduler.run_batch(batch)
            scheduler._apply_war_barrier()
            queue.append((batch.copy(), result))
        if scheduler.last_batch and not serial and queue:
            process(*queue.popleft())
        scheduler.launch_batch_sample_if_needed(result, batch)
        scheduler.last_batch = batch
        if not batch and not queue:
            return done
    raise RuntimeError(f"requests still running after {max_iters} scheduler iterations")


class StepLog:
    """What each decode step's verification saw and decided, recorded around the plugin's own
    methods (observation only: every call goes on to the real method)."""

    def __init__(self, worker):
        self.worker = worker
        self.steps: list[dict] = []
        self.verify_inputs: list[dict] = []
        self.phase = ""
        self.compact_verifies: dict[str, int] = {}  # phase -> calls of the packed verify path

    def install(self):
        from sglang_adaflash.sglang_plugin import worker as wmod

        log = self
        accept = wmod.AdaFlashWorkerV2._accept_block
        compact_verify = wmod.AdaFlashWorkerV2._compact_verify

        def counted_compact_verify(self, *args, **kwargs):
            log.compact_verifies[log.phase] = log.compact_verifies.get(log.phase, 0) + 1
            return compact_verify(self, *args, **kwargs)

        wmod.AdaFlashWorkerV2._compact_verify = counted_compact_verify
        real_target = self.worker._target_worker
        target_forward = real_target.forward_batch_generation

        def accept_block(self, *, candidates, **kwargs):
            step = self.__dict__.get("_ada_step")
            logits = kwargs.get("next_token_logits")
            sampling = kwargs.get("sampling_info")
            verify = log.verify_inputs[-1] if log.verify_inputs else None
            # a greedy compact step hands DFlash a storage-less stand-in (length_budget.
            # no_logits) and its tokens instead: rebuild the strided logits from the target's
            # packed output for the checks, as the scatter-back would have
            stand_in = logits is not None and logits.stride(0) == 0
            record = {
                "phase": log.phase,
                "candidates": candidates.clone(),
                "logits": None if logits is None
                else strided_logits(verify["packed_logits"], step.plan.verify_lens_cpu, logits)
                if stand_in else logits.clone(),
                "logits_stand_in": stand_in,
                "predict": None if getattr(step, "target_predict", None) is None
                else step.target_predict.clone(),
                "logits_ptr": None if logits is None else logits.untyped_storage().data_ptr(),
                "prefix_lens": kwargs["prefix_lens"].clone(),
                "verify_lens": None if step is None or step.plan is None
                else list(step.plan.verify_lens_cpu),
                "temperatures": None if sampling is None or sampling.temperatures is None
                else sampling.temperatures.view(-1).clone(),
                "top_ks": None if sampling is None else sampling.top_ks.view(-1).clone(),
                "top_ps": None if sampling is None else sampling.top_ps.view(-1).clone(),
                "verify": verify,
                "buffers": {
                    k: b.tensor.untyped_storage().data_ptr()
                    for k, b in self.__dict__.get("_ada_scatter_buffers", {}).items()
                    if b.tensor is not None
                },
            }  # fmt: skip
            log.verify_inputs.clear()
            out = accept(self, candidates=candidates, **kwargs)
            accept_len, commit_lens, bonus, out_tokens, _ = out
            record.update(
                accept_len=accept_len.clone(),
                commit_lens=commit_lens.clone(),
                bonus=bonus.clone(),
                out_tokens=out_tokens.clone(),
            )
            log.steps.append(record)
            return out

        def forward(*args, **kwargs):
            fb = kwargs.get("forward_batch")
            if kwargs.get("is_verify") and fb is not None:
                req_to_token = real_target.model_runner.req_to_token_pool.req_to_token
                log.verify_inputs.append(
                    {
                        "input_ids": fb.input_ids.clone(),
                        "positions": fb.positions.clone(),
                        "out_cache_loc": fb.out_cache_loc.clone(),
                        "req_pool_indices": fb.req_pool_indices.clone(),
                        "req_to_token": req_to_token[fb.req_pool_indices.long()].clone(),
                        "ragged": getattr(fb.spec_info, "ragged_verify_layout", None) is not None,
                    }
                )
            out = target_forward(*args, **kwargs)
            if kwargs.get("is_verify") and fb is not None:
                log.verify_inputs[-1]["packed_logits"] = out.logits_output.next_token_logits.clone()
            return out

        wmod.AdaFlashWorkerV2._accept_block = accept_block
        real_target.forward_batch_generation = forward


def strided_logits(packed: torch.Tensor, verify_lens: list[int], like: torch.Tensor):
    """Packed verify logits [T, V] -> [bs*B, V] with request i's rows at i*B.., zeros past L_i."""
    block = like.shape[0] // len(verify_lens)
    out = torch.zeros(like.shape, dtype=packed.dtype)
    row = 0
    for i, n in enumerate(verify_lens):
        out[i * block : i * block + n] = packed[row : row + n]
        row += n
    return out


class SyncTrap:
    """Records every host read of a tensor inside the plugin's part of a decode step.

    From the moment the drafter's output reaches the plugin until the verify logits are back,
    nothing may wait for the device: no ``tolist``/``item``/``cpu``/``numpy``, no Python
    ``int``/``float``/``bool``/``index`` of a tensor, no ``torch.tensor(..., device=...)``
    (a pageable host-to-device copy waits for the stream too). SGLang's own verify preparation
    and the target forward (what DFLASH runs too, CUDA-graph replays on a GPU) are outside the
    window. Here every tensor is on the CPU, so each such call is recorded with its caller
    rather than measured."""

    READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
    #: The shared planner reads its inputs to the host (numpy) only when they are on a CPU,
    #: where a read costs nothing (planner/lengths.py); on a GPU it runs fixed rounds in torch.
    CPU_ONLY = {("lengths.py", "plan_lengths")}

    def __init__(self):
        self.depth = 0  # > 0: inside the window
        self.windows = 0
        self.violations: list[str] = []

    def _record(self, what):
        if self.depth > 0:
            frame = sys._getframe(2)
            if (Path(frame.f_code.co_filename).name, frame.f_code.co_name) in self.CPU_ONLY:
                return
            self.violations.append(f"{what} at {Path(frame.f_code.co_filename).name}:"
                                   f"{frame.f_lineno} ({frame.f_code.co_name})")

    def install(self, worker_cls):
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput

        trap = self
        for name in self.READS:
            original = getattr(torch.Tensor, name)

            def read(self, *a, _orig=original, _name=name, **k):
                trap._record(f"Tensor.{_name}")
                return _orig(self, *a, **k)

            setattr(torch.Tensor, name, read)
        tensor = torch.tensor

        def make(*a, **k):
            if k.get("device") is not None:
                trap._record("torch.tensor(..., device=...)")
            return tensor(*a, **k)

        torch.tensor = make

        def window(fn, on):
            def wrapped(*a, **k):
                trap.depth += 1 if on else -1
                try:
                    return fn(*a, **k)
                finally:
                    trap.depth -= 1 if on else -1

            return wrapped

        draft = worker_cls._on_draft_output

        def on_draft(self, out):
            trap.windows += 1
            return window(draft, True)(self, out)

        worker_cls._on_draft_output = on_draft
        worker_cls._compact_verify = window(worker_cls._compact_verify, True)
        DFlashVerifyInput.prepare_for_verify = window(DFlashVerifyInput.prepare_for_verify, False)

    def outside(self, fn):
        """``fn`` (the target forward) runs outside the window."""

        def wrapped(*a, **k):
            saved, self.depth = self.depth, 0
            try:
                return fn(*a, **k)
            finally:
                self.depth = saved

        return wrapped


def publish_perturbed(home: Path) -> str:
    """The embedded drafter's weights, perturbed, as the next version in ``home``."""
    from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR
    from sglang_adaflash.drafter.checkpoint import read_checkpoint
    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_version

    cfg, state = read_checkpoint(DRAFTER_DIR)
    g = torch.Generator().manual_seed(7)
    new = {
        k: (v.float() + 0.02 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype)
        if v.is_floating_point() and v.numel() > 1 else v
        for k, v in state.items()
    }  # fmt: skip
    publish_version(home, cfg, state, target=target_fingerprint(TARGET_DIR))  # v000001
    return publish_version(home, cfg, new, target=target_fingerprint(TARGET_DIR))


class ReloadUnderLoad:
    """Between two decode steps with requests running, publish a new drafter version and let
    the watcher stage it; the worker's own step boundary then swaps it in through SGLang's draft
    model. ``check`` (a step later) says what the swap did."""

    def __init__(self, worker, work: Path):
        from sglang.srt.speculative.dflash_worker_v2 import _get_fused_kv_materialize_helper

        self.worker = worker
        self.work = work
        self.helper_cls = _get_fused_kv_materialize_helper()
        self.result: dict = {}

    def fresh_helper(self):
        """SGLang builds its fused draft-KV helper on CUDA only; the real class, built here, is
        what the reload must refresh in place."""
        w = self.worker
        first = w.draft_model.layers[0].self_attn
        return self.helper_cls(
            layers=w.draft_model.layers,
            rotary_emb=first.rotary_emb,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            device=w.device,
            max_position_hint=512 + int(w.block_size),
        )

    def stage(self):
        w = self.worker
        w._fused_kv_helper = self.fresh_helper()
        helper = w._fused_kv_helper
        self.stacks = (helper.flat_kv_weight_t, helper.k_norm_weights)
        self.stack_ptrs = [t.data_ptr() for t in self.stacks]
        params = dict(w.draft_model.named_parameters())
        self.ptrs = {k: p.data_ptr() for k, p in params.items()}
        self.before = {k: p.detach().clone() for k, p in params.items()}
        self.version = publish_perturbed(self.work / "home")
        (self.work / "fleet-version").write_text(self.version + "\n")
        w._ada_reloader.poll_once()
        self.result["staged"] = w._ada_reloader.status.staged_version

    def check(self):
        w = self.worker
        after = dict(w.draft_model.named_parameters())
        ref = self.fresh_helper()
        self.result.update(
            version=self.version,
            loaded=w._ada_reloader.status.loaded_version,
            in_place=all(after[k].data_ptr() == p for k, p in self.ptrs.items()),
            changed=sorted(k for k in self.before if not torch.equal(self.before[k], after[k])),
            helper_in_place=[t.data_ptr() for t in self.stacks] == self.stack_ptrs,
            helper_matches_fresh=bool(
                torch.equal(self.stacks[0], ref.flat_kv_weight_t)
                and torch.equal(self.stacks[1], ref.k_norm_weights)
            ),
            last_error=w._ada_reloader.status.last_error,
        )


class _Done(Exception):
    """Ends a --light run after its greedy phase."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", default="compact", choices=["compact", "cap", "fixed"])
    ap.add_argument("--dispatch", default="torch", choices=["torch", "triton"])
    ap.add_argument("--max-new", type=int, default=20)
    ap.add_argument("--attention", default="fa3", choices=["fa3", "triton"],
                    help="target attention: the FA3 stand-in, or SGLang's Triton backend "
                    "(interpreted; with the plugin's ragged-verify extension in compact mode)")
    ap.add_argument("--draft-attention", default="fa3", choices=["fa3", "triton"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="model dtype (auto: the checkpoint's bfloat16)")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="synchronous scheduling (default: SGLang's overlap scheduler)")
    ap.add_argument("--no-radix", dest="radix", action="store_false",
                    help="no radix (prefix) cache (default: on)")
    ap.add_argument("--prompt-tokens", type=int, default=160,
                    help="keep the last N tokens of each prompt (interpreted attention is slow)")
    ap.add_argument("--light", action="store_true",
                    help="greedy requests only (three, one joining mid-run), no reload: the "
                    "interpreted attention kernels take minutes per run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"mode": args.mode, "dispatch": args.dispatch, "order": []}

    def write():
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    backend = install_seams(args.dispatch)
    kernels = Kernels()
    kernels.install()
    t0 = time.time()
    try:
        scheduler = build_scheduler(args, args.out, summary["order"])
    except Exception:
        summary["error"] = traceback.format_exc()
        write()
        return 1
    summary["build_s"] = round(time.time() - t0, 1)
    worker = scheduler.draft_worker
    summary["worker"] = {
        "class": type(worker).__name__,
        "mode": worker._ada_mode,
        "head": worker._ada_planner.head is not None,
        "target_backend": type(worker._target_worker.model_runner.attn_backend).__name__,
        "draft_backend": type(worker.draft_model_runner.attn_backend).__name__,
    }
    for layer in worker.draft_model.layers:
        layer.self_attn.use_table_qk_norm_rope = False
    if args.dispatch == "triton":
        worker._use_triton_prepare_block = True
        worker._use_triton_accept_bonus = True
    log = StepLog(worker)
    log.install()
    trap = SyncTrap()
    if args.mode == "compact":
        from sglang_adaflash.sglang_plugin.worker import AdaFlashWorkerV2

        trap.install(AdaFlashWorkerV2)
        target = worker._target_worker
        target.forward_batch_generation = trap.outside(target.forward_batch_generation)
    inputs = prompts(args.prompt_tokens)
    try:
        torch.manual_seed(0)
        kernels.enabled = True
        # 1) greedy requests of different lengths; the drafter is hot-reloaded after step 3
        log.phase = "greedy"
        for i, ids in enumerate(inputs[: 2 if args.light else 4]):
            submit(scheduler, f"g{i}", ids, 0.0, args.max_new - 3 * i)
        reload = ReloadUnderLoad(worker, args.out)
        decode_steps = [0]

        def on_step(batch):
            if batch.forward_mode.is_decode():
                decode_steps[0] += 1
                if decode_steps[0] == 2:  # a request joins the running batch
                    submit(scheduler, "join", inputs[5], 0.0, args.max_new - 2)
                if args.light:
                    return
                if decode_steps[0] == 4:
                    reload.stage()
                elif decode_steps[0] == 5:
                    reload.check()

        backend.metadata_calls.clear()
        cached: dict[str, int] = {}
        summary["scheduler"] = {"overlap": scheduler.enable_overlap, "radix": args.radix,
                                "cached_tokens": cached}  # fmt: skip
        outputs = run_to_completion(scheduler, on_step, cached=cached)
        summary["metadata_calls"] = list(backend.metadata_calls)
        summary["reload"] = reload.result
        if args.light:
            raise _Done
        # 2) greedy and sampled requests in one batch
        log.phase = "mixed"
        for i, ids in enumerate(inputs[2:6]):
            submit(scheduler, f"m{i}", ids, 0.0 if i % 2 == 0 else 1e-3, args.max_new - 4)
        backend.metadata_calls.clear()
        outputs.update(run_to_completion(scheduler, cached=cached))
        summary["metadata_calls_mixed"] = list(backend.metadata_calls)
    except _Done:
        pass
    except Exception:
        summary["error"] = traceback.format_exc()
        write()
        return 1
    finally:
        kernels.enabled = False
        worker._ada_reloader.stop()
    summary["outputs"] = outputs
    summary["kernels"] = {k: sorted(v) for k, v in sorted(kernels.callers.items())}
    summary["steps"] = len(log.steps)
    summary["compact_verifies"] = log.compact_verifies
    summary["sync_trap"] = {"windows": trap.windows, "violations": trap.violations[:50]}
    torch.save(log.steps, args.out / "steps.pt")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
