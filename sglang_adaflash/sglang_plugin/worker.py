"""``AdaFlashWorkerV2``: SGLang's DFlash V2 worker plus the length head, compact verification,
hot reload and metrics.

SGLang's ``DFlashWorkerV2.forward_batch_generation`` is one long function. Rather than copy it,
the subclass joins it at three seams that it already exposes, for the duration of one decode
step only:

1. **after drafting**: the draft model runner is wrapped for the step, so the drafter's final
   normed block states (``logits_output.hidden_states``, ``[bs*B, H]``) reach the length head,
   and :class:`~.length_budget.VerifyPlanner` turns them into verify lengths for the batch;
2. **verification** (compact mode): ``self.target_worker`` answers with a proxy whose verify
   call rebuilds the verify batch packed to the chosen lengths (SGLang's
   ``BuildRaggedVerifyWindow`` + ``DFlashVerifyInput(ragged_verify_layout=...)``), runs the
   target on ``sum(L)`` tokens, and scatters its hidden states back to the strided ``[bs*B]``
   layout (``ScatterCompactToStrided``) that the rest of the DFlash step expects; of the
   logits, a greedy step scatters only their argmax (DFlash's ``target_predict``), other steps
   the logits themselves;
3. **acceptance**: ``_accept_block`` sees candidates capped at each request's length, so no
   proposal past an unverified slot is ever accepted, and the bonus token comes from a verified
   slot. Sampled batches verify whole blocks (see ``VerifyPlanner.plan``).

Between steps (before any forward) the hot reloader may swap drafter weights in place; the
verify lengths of each step are also returned as ``cap_lens``, which feeds SGLang's own
``spec_cap_length`` metrics, and matched with SGLang's host-side accept counts for the
``adaflash_*`` metrics. In Kubernetes, TP rank 0 also keeps its pod's ``adaflash.io/``
annotations current (loaded version, load error, live acceptance tau, traffic record count; see
``sglang_adaflash.serving.pod_status``).

In production this runs on CUDA only. The tests run the whole worker on CPU inside SGLang's own
scheduler, with CUDA-only kernels swapped at their lowest seam and SGLang's Triton kernels
interpreted (``tests/sglang_plugin/cpu_sglang.py``); ``scripts/sglang_gpu_check.py`` checks it
on a GPU.
"""

from __future__ import annotations

import logging
import os

import torch
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_utils import draft_tp_context

from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.serving import reload as rl
from sglang_adaflash.serving.metrics import (
    AcceptanceWindow,
    BackgroundSink,
    FanoutSink,
    LoggingSink,
    MetricsSink,
)
from sglang_adaflash.serving.pod_status import (
    DEFAULT_REPORT_S,
    PodStatsPublisher,
    RequestLogCounter,
    request_log_dirs,
)

from . import length_budget as lb
from .backends import install_ragged_backends
from .compact_verify import CompactVerify, CompactVerifyTarget
from .options import (
    VERIFY_CAP,
    VERIFY_COMPACT,
    VERIFY_FIXED,
    AdaFlashOptions,
    read_draft_config,
    resolved_verify_mode,
)
from .runtime import (
    HeadLoadError,
    SGLangDraftTarget,
    StepStatsQueue,
    checkpoint_dtypes,
    expected_draft_spec,
    initial_version,
    load_length_head,
    local_checkpoint_dir,
    refresh_fused_kv_helper,
    sglang_resolved_fields,
)
from .server_args import RAGGED_VERIFY_BACKENDS

logger = logging.getLogger(__name__)

DOMAIN_KEY = "domain"  # sampling_params.custom_params["domain"] tags a request's domain


class _RunnerTap:
    """Forwards everything to a model runner; hands each forward's output to ``on_output``."""

    def __init__(self, runner, on_output):
        self._runner = runner
        self._on_output = on_output

    def forward(self, *args, **kwargs):
        out = self._runner.forward(*args, **kwargs)
        self._on_output(out)
        return out

    def __getattr__(self, name):
        return getattr(self._runner, name)


class _Step:
    """What one decode step carries between the seams (host values, decided before drafting,
    and the plan, on the device)."""

    def __init__(self, batch, greedy: bool, domains, remaining=None, budget=None):
        self.batch = batch
        self.greedy = greedy
        self.domains = domains
        self.remaining = remaining  # [bs] tokens each request may still generate, or None
        self.budget: lb.HostBudget | None = budget  # compact mode: the host's total
        self.plan: lb.VerifyPlan | None = None
        self.passthrough = False  # whole blocks through DFlash's own verify batch
        # [bs*B] long: the target's greedy tokens (compact greedy steps, which hand DFlash no
        # [bs*B, V] logits), or None
        self.target_predict = None


class AdaFlashWorkerV2(CompactVerify, DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker, *args, **kwargs):
        super().__init__(server_args, gpu_id, nccl_port, target_worker, *args, **kwargs)
        self._ada_step: _Step | None = None
        self._ada_tp_rank = get_parallel().tp_rank
        # The ranks that run this rank's batch: the whole TP group, or under DP attention the
        # attention-TP group. Verify lengths and reload swaps are agreed within it only; idle
        # DP peers skip the draft and the reload point, so a TP-wide collective would hang.
        self._ada_tp_group = get_dp_tp_group()
        self._ada_opts = AdaFlashOptions.resolve(server_args.speculative_draft_model_path)
        self._ada_mode = resolved_verify_mode() or VERIFY_FIXED
        install_ragged_backends()  # before SGLang builds the attention backends (after us)
        self._ada_ckpt = local_checkpoint_dir(server_args.speculative_draft_model_path)
        self._ada_planner = self._build_planner()
        sink = self._build_sink()
        self._ada_sink = sink
        # per-step records leave the scheduler thread at once; a daemon thread feeds the sinks
        self._ada_stats = StepStatsQueue(BackgroundSink(sink))
        # the previous steps' mean rule length: the host's total for the next compact step
        self._ada_lag = lb.LaggedMean(float(self.block_size))
        self._ada_uniform_layouts: dict[int, object] = {}
        self._ada_reloader = self._build_reloader(sink)
        if self._ada_tp_rank == 0:
            logger.warning(
                "ADAFLASH worker: verify mode %s, block %d, length head %s, drafter %s",
                self._ada_mode,
                int(self.block_size),
                "on" if self._ada_planner.head is not None else "off",
                self._ada_reloader.status.loaded_version if self._ada_reloader else "?",
            )

    # -- construction --------------------------------------------------------------------------

    def _drafter_config(self):
        """The drafter's config as DFLASH reads it: every spelling DFLASH accepts, with the
        mask token id and target layer count SGLang resolved where the file leaves them out."""
        from sglang_adaflash.drafter.checkpoint import read_config

        return read_config(self._ada_ckpt, resolved=self._ada_config_resolved())

    def _ada_config_resolved(self) -> dict:
        state = self.__dict__
        return sglang_resolved_fields(
            read_draft_config(self._ada_ckpt),
            mask_token=state.get("_mask_token"),
            mask_token_id=state.get("_mask_token_id"),
        )

    def _build_planner(self) -> lb.VerifyPlanner:
        opts = self._ada_opts
        head = None
        if opts.use_length_head and self._ada_mode != VERIFY_FIXED:
            cfg = self._drafter_config()
            try:
                head = load_length_head(
                    self._ada_ckpt, cfg.hidden_size, cfg.length_head_bottleneck_dim, self.device
                )
            except HeadLoadError as e:
                if self._ada_mode == VERIFY_COMPACT:
                    # The target's verify graphs are keyed by token buckets in compact mode:
                    # stay compact and verify whole blocks, so the graphs still replay.
                    logger.error("ADAFLASH: %s; verifying whole blocks (compact layout)", e)
                else:
                    logger.error("ADAFLASH: %s; falling back to fixed-length verification", e)
                    self._ada_mode = VERIFY_FIXED
        cost = StepCostModel(fixed=opts.cost_fixed_s, per_token=opts.cost_per_token_s)
        return lb.VerifyPlanner(
            head,
            int(self.block_size),
            rate=opts.rate,
            min_len=opts.min_len,
            cost=cost,
            rule=opts.length_rule,
        )

    def init_attention_backends(self):
        # SGLang builds this worker before any attention backend exists (the scheduler calls
        # init_all_attention_backends afterwards, target first), so the live backend can only
        # be checked here.
        super().init_attention_backends()
        self._ada_check_backend()

    def _ada_check_backend(self) -> None:
        """Compact mode was decided from the arguments; confirm it with the live backend."""
        if self._ada_tp_rank == 0:
            logger.warning(
                "ADAFLASH: verify mode %s on target attention backend %s",
                self._ada_mode,
                type(self.target_worker.model_runner.attn_backend).__name__,
            )
        if self._ada_mode != VERIFY_COMPACT:
            return
        if self.__dict__.get("_need_mamba_verify_commit"):
            raise RuntimeError(
                "ADAFLASH compact verification does not support hybrid (Mamba/linear-attention) "
                "targets, whose recurrent state is committed from whole verify blocks; set "
                "ADAFLASH_VERIFY_MODE=fixed"
            )
        backend = self.target_worker.model_runner.attn_backend
        ok = bool(
            getattr(backend, "supports_ragged_verify_graph", False)
            or getattr(backend, "supports_ragged_verify", False)  # eager (FlashInfer)
        )
        if not ok:
            raise RuntimeError(
                f"ADAFLASH compact verification needs a target attention backend with ragged "
                f"verify ({', '.join(sorted(RAGGED_VERIFY_BACKENDS))}), but the live backend is "
                f"{type(backend).__name__}; pass --attention-backend fa3 or set "
                "ADAFLASH_VERIFY_MODE=fixed"
            )

    def _build_sink(self) -> MetricsSink:
        sinks: list[MetricsSink] = [LoggingSink()]
        if self._ada_opts.metrics and self._ada_tp_rank == 0:
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                from sglang_adaflash.serving.metrics import PrometheusSink

                sinks.append(PrometheusSink(max_block_size=int(self.block_size)))
            else:
                logger.warning(
                    "ADAFLASH: adaflash_* metrics need --enable-metrics (Prometheus "
                    "multiprocess mode); logging a summary instead"
                )
        return FanoutSink(sinks)

    def _build_reloader(self, sink) -> rl.HotReloader | None:
        cfg = self._drafter_config()
        draft = SGLangDraftTarget(
            self.draft_model,
            expected_draft_spec(cfg, checkpoint_dtypes(self._ada_ckpt)),
            context=lambda: draft_tp_context(self.draft_parallel_layout),
            refresh=self._refresh_derived_draft_state,
        )
        parts: dict[str, rl.ReloadTarget] = {"draft": draft}
        if self._ada_planner.head is not None:
            parts["head"] = rl.ModuleTarget(self._ada_planner.head, prefix="thresh_head_two_model.")
        group = (
            rl.TorchDistGroup(self._ada_tp_group.cpu_group)
            if int(self._ada_tp_group.world_size) > 1
            else rl.SingleRank()
        )
        reporters = rl.reporters_from_env() if self._ada_tp_rank == 0 else []
        self._ada_pod_stats = self._build_pod_stats(reporters, sink)
        reloader = rl.HotReloader(
            source=rl.DesiredVersionSource.from_env(),
            target=rl.CompositeTarget(parts),
            loaded_version=initial_version(self._ada_ckpt),
            live_config=cfg,
            group=group,
            sink=sink if self._ada_tp_rank == 0 else None,
            reporters=reporters,
            poll_interval_s=float(os.environ.get(rl.ENV_POLL_S, "5")),
            sync_every_steps=int(os.environ.get(rl.ENV_SYNC_STEPS, "16")),
            require_manifest=os.environ.get(rl.ENV_REQUIRE_MANIFEST, "1") != "0",
            target_dir=_local_config_dir(self.server_args.model_path),
            config_resolved=self._ada_config_resolved(),
        )
        reloader.start()
        if self._ada_pod_stats is not None:
            self._ada_pod_stats.start()
        return reloader

    def _build_pod_stats(self, reporters, sink) -> PodStatsPublisher | None:
        """In Kubernetes (rank 0 only): live tau and the traffic count as pod annotations."""
        pod = next((r for r in reporters if isinstance(r, rl.PodAnnotationReporter)), None)
        if pod is None:
            return None
        window = AcceptanceWindow()
        if isinstance(sink, FanoutSink):
            sink.sinks.append(window)
        else:  # a sink built elsewhere: tau from this window is not fed, so do not report it
            window = None
        dirs = request_log_dirs(self.server_args)
        if not dirs:
            logger.warning(
                "ADAFLASH: SGLang logs no requests to a directory (--log-requests "
                "--log-requests-target <dir>), so this pod reports %s=0",
                rl.TRAFFIC_RECORDS_ANNOTATION,
            )
        return PodStatsPublisher(
            pod,
            window=window,
            traffic=RequestLogCounter(dirs) if dirs else None,
            interval_s=float(os.environ.get(rl.ENV_POD_REPORT_S) or DEFAULT_REPORT_S),
        )

    def _refresh_derived_draft_state(self) -> None:
        helper = self.__dict__.get("_fused_kv_helper")  # no __getattr__ forwarding
        if helper is not None:
            refresh_fused_kv_helper(helper, self.draft_model.layers)

    # -- the three seams -----------------------------------------------------------------------

    @property
    def target_worker(self):
        # Read __dict__ directly: SGLang's __init__ reads this property before our attributes
        # exist, and DFlashWorkerV2.__getattr__ forwards missing names to target_worker, which
        # would recurse.
        state = self.__dict__
        step = state.get("_ada_step")
        if step is not None and state.get("_ada_mode") == VERIFY_COMPACT:
            return CompactVerifyTarget(self._target_worker, self)
        return self._target_worker

    def forward_batch_generation(
        self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ):
        if "_ada_stats" not in self.__dict__:  # a forward during SGLang's own __init__
            return super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        if not batch.forward_mode.is_idle():
            self._ada_reloader.at_step_boundary()  # swap drafter weights between steps only
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        if not decode or batch.forward_mode.is_idle() or self._ada_mode == VERIFY_FIXED:
            result = super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
            if decode and not batch.forward_mode.is_idle():
                block = int(self.block_size)
                self._ada_stats.push(block, [block] * len(batch.seq_lens), _request_domains(batch))
            return result
        sampling = batch.sampling_info
        greedy = sampling is None or sampling.is_all_greedy
        remaining = _remaining_tokens(batch)
        step = _Step(batch, greedy, _request_domains(batch), remaining)
        if self._ada_mode == VERIFY_COMPACT and greedy and self._ada_planner.head is not None:
            step.budget = self._ada_host_budget(len(batch.seq_lens), remaining)
        real_runner = self.draft_model_runner
        self.draft_model_runner = _RunnerTap(real_runner, self._on_draft_output)
        self._ada_step = step
        try:
            result = super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        finally:
            self.draft_model_runner = real_runner
            self._ada_step = None
        plan = step.plan or lb.VerifyPlan.uniform(
            len(batch.seq_lens), int(self.block_size), "uniform", self.device
        )
        result.cap_lens = plan.lengths  # feeds sglang:spec_cap_length
        self._ada_stats.push(plan.block_size, plan.lengths, step.domains)
        return result

    def _ada_host_budget(self, bs: int, remaining) -> lb.HostBudget:
        """The compact step's total from host values only (see length_budget)."""
        grid, max_slots = lb.capture_grid(self._target_worker.model_runner)
        return lb.plan_host_budget(
            block_size=int(self.block_size),
            min_len=self._ada_planner.min_len,
            remaining=remaining,
            bs=bs,
            mean_len=self._ada_lag.read(),
            grid=grid,
            max_slots=max_slots,
        )

    def _ada_uniform_layout(self, bs: int):
        """Whole blocks for ``bs`` requests, built once per batch size on the device."""
        layout = self._ada_uniform_layouts.get(bs)
        if layout is None:
            block = int(self.block_size)
            lens = torch.full((bs,), block, dtype=torch.int32, device=self.device)
            layout = lb.verify_layout(lens, total=bs * block, graph_num_tokens=bs * block)
            self._ada_uniform_layouts[bs] = layout
        return layout

    def _on_draft_output(self, draft_out) -> None:
        step = self._ada_step
        if step is None or step.plan is not None:
            return
        bs = len(step.batch.seq_lens)
        hidden = getattr(getattr(draft_out, "logits_output", None), "hidden_states", None)
        plan = self._ada_planner.plan(
            hidden, bs, greedy=step.greedy, max_len=step.remaining, budget=step.budget
        )
        plan = self._agree_across_tp(plan)
        if plan.rule_lengths is not None:
            self._ada_lag.push(plan.rule_lengths)
        step.plan = plan
        if plan.is_uniform:
            grid, max_slots = lb.capture_grid(self._target_worker.model_runner)
            whole = bs * int(self.block_size)
            step.passthrough = grid is None or (
                whole in grid and (max_slots is None or bs <= max_slots)
            )

    def _agree_across_tp(self, plan: lb.VerifyPlan) -> lb.VerifyPlan:
        """All TP ranks must verify the same lengths: rank 0's, broadcast on the device (no
        CPU collective, no host read). The host totals already agree: every rank computes
        them from the same lagged lengths and batch."""
        if int(self._ada_tp_group.world_size) == 1 or plan.is_uniform:
            return plan
        self._ada_tp_group.broadcast(plan.lengths, src=0)
        if plan.rule_lengths is not None:
            self._ada_tp_group.broadcast(plan.rule_lengths, src=0)
        return plan

    def _accept_block(self, *, candidates, **kwargs):
        step = self.__dict__.get("_ada_step")
        if (
            step is not None
            and step.greedy
            and step.plan is not None
            and not step.plan.is_uniform
            and self.__dict__.get("_ada_mode") in (VERIFY_COMPACT, VERIFY_CAP)
        ):
            capped = lb.cap_candidates(candidates, step.plan.lengths)
            if step.target_predict is not None:  # compact greedy: the packed rows' argmax
                kwargs["target_predict"] = step.target_predict
            accept_len, commit_lens, bonus, out_tokens, new_seq_lens = super()._accept_block(
                candidates=capped, **kwargs
            )
            # Slots past the commit keep shifted candidates; never let the marker leak out.
            out_tokens.clamp_(min=0)
            return accept_len, commit_lens, bonus, out_tokens, new_seq_lens
        return super()._accept_block(candidates=candidates, **kwargs)

    # -- host-side hooks SGLang calls ----------------------------------------------------------

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)
        if self.__dict__.get("_ada_tp_rank") == 0 and "_ada_stats" in self.__dict__:
            self._ada_stats.complete(list(num_correct_drafts_per_req))


def _local_config_dir(path) -> str | None:
    """The target's directory when it is local (manifests name the target by its config)."""
    return str(path) if path and os.path.isfile(os.path.join(str(path), "config.json")) else None


def _remaining_tokens(batch) -> list[int] | None:
    """Tokens each request may still generate (a verify length above it is wasted)."""
    out = []
    for req in getattr(batch, "reqs", None) or []:
        limit = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
        produced = getattr(req, "output_ids", None)
        if limit is None or produced is None:
            return None
        out.append(max(1, int(limit) - len(produced)))
    return out or None


def _request_domains(batch) -> list[str | None] | None:
    domains = []
    for req in batch.reqs:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        value = params.get(DOMAIN_KEY) if isinstance(params, dict) else None
        domains.append(str(value) if value else None)
    return domains if any(domains) else None
