"""The reference engine: continuous batching with lossless block speculative decoding.

Each step runs one drafter forward for the whole batch, chooses every request's verify length,
runs one ragged target forward over all candidates, accepts, commits, and retires finished
requests; waiting requests join between steps. Modes: `ar` (plain decoding, verify length 1),
`dflash` (the whole block), `adaflash` (the length head and the load-aware rule).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator

import torch

from ..core import flashinfer_sampling
from ..core.clock import synced_time
from ..core.rejection import RejectionSampler, VerifyResult
from ..core.sampling import RequestError, filtered_probs, greedy_ids
from ..core.spec_metadata import RowSampling
from ..drafter.model import DFlashDrafter
from ..planner.calibration import SurvivalPosterior
from ..planner.confidence import ConfidenceCalibration
from ..planner.cost import OnlineCostModel, StepCostModel
from ..planner.prior import acceptance_prior
from ..target.hf_target import HFTarget, TargetBatch, pad_packed
from .admission import admit_waiting
from .context_backlog import ContextBacklog
from .draft_choice import DraftChoice
from .proposals import DraftedRows
from .proposer import DFlashProposer
from .request import Request, RequestOutput, RequestStats
from .sizing import profile_step_cost
from .step_state import EngineStats, SpecBatch, _Seq

MODES = ("ar", "dflash", "adaflash")
# A prompt's target features (tokens x captured width) held for a lazy drafter context; above
# this they are projected at prefill (4M floats: 16 MiB in float32 per request)
_LAZY_PROMPT_ELEMENTS = 1 << 22
LENGTH_RULES = ("load_aware", "paper")
# Where adaflash's load-aware verify lengths come from: each request's verification history
# alone, planned before drafting so the drafter computes only the slots verified ("history"), or
# the history plus the length head's reading of the whole drafted block ("head").
LENGTH_SOURCES = ("history", "head")
# A request's own evidence kept per step it is not drafted: about half after eight tokens, where a
# position's accepted count correlates 0.13 with the count eight tokens before (SurvivalPosterior.idle)
IDLE_DECAY = 0.92


class SpecEngine(ContextBacklog, DraftedRows):
    def __init__(
        self,
        target: HFTarget,
        drafter: DFlashDrafter | None = None,
        *,
        mode: str = "adaflash",
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        length_rule: str = "load_aware",
        cost_model: StepCostModel | None = None,
        seed: int = 0,
        proposer=None,
        calibrate: bool = True,
        draft_off: bool = True,
        probe_every: int = 16,
        probe_share: float = 0.02,
        explore: bool = False,
        lengths_from: str = "history",
        confidence_trim: bool = False,
        idle_decay: float = IDLE_DECAY,
    ):
        """`proposer` replaces the DFlash proposer (tests, other drafting methods); it must offer
        propose(last, ctx_lens, histories, slots) -> block states [n, B, H],
        proposal_logits(states, rows, slots) -> [m, V], extend_context(feats, starts, slots),
        move(src, dst, length) and release(slot) (the slot's request left).

        In adaflash mode with the load-aware rule, `calibrate` corrects the head by each
        request's (and domain's) verification history, and `draft_off` lets the rule leave out
        requests whose drafts do not pay for themselves, drafting them after `probe_every`
        steps to see whether that changed (the gap doubles after each probe that accepts
        nothing, up to 4 * probe_every, and resets when one accepts) as far as a credit of
        `probe_share` of the plain steps' cost pays for it (1.0: probe whenever due). With
        `explore` the draft-or-not plan reads a draw from each request's survival posterior
        rather than its mean, so a request whose evidence is thin or mixed keeps being tried.

        `lengths_from` (adaflash, load-aware rule with draft-off): "head" drafts the whole block
        and plans lengths from the length head's reading of it, calibrated by each request's
        history; "history" plans them from the history alone, before drafting, and the drafter
        then computes only the slots that will be verified (its proposals are the whole block's
        at those slots: every slot still gives keys and values). docs/engine.md says which pays
        where. With "history", `confidence_trim` then ends each planned row's verify where the
        drafter's own probabilities say its proposals will mostly be rejected
        (planner.confidence; off by default: on the embedded pair it has not yet been measured
        to pay, docs/engine.md). `idle_decay`: how much of a request's own acceptance evidence
        survives each step it is not drafted (SurvivalPosterior.idle; 1 keeps it all)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "ar" and drafter is None and proposer is None:
            raise ValueError(f"mode {mode!r} needs a drafter")
        if mode == "adaflash" and (drafter is None or drafter.length_head is None):
            raise ValueError(
                "mode 'adaflash' needs a drafter with an adaptive length head "
                "(dflash_config.use_thresh_head_two_model); use mode 'dflash' for this drafter"
            )
        if length_rule not in LENGTH_RULES:
            raise ValueError(f"length_rule must be one of {LENGTH_RULES}, got {length_rule!r}")
        if lengths_from not in LENGTH_SOURCES:
            raise ValueError(f"lengths_from must be one of {LENGTH_SOURCES}, got {lengths_from!r}")
        self.target, self.drafter, self.mode = target, drafter, mode
        self.block_size = drafter.config.block_size if drafter is not None else 1
        if proposer is not None:
            self.block_size = proposer.block_size
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.length_rule = length_rule
        self.device = target.device
        capacity = max_seq_len + self.block_size + 1
        self.cache = target.new_cache(max_batch_size, capacity)
        self.proposer = proposer
        if proposer is not None:
            target.capture_layer_ids = list(getattr(proposer, "target_layer_ids", []))
        elif mode != "ar":
            drafter.share_target_modules(target.embed_tokens, target.lm_head)
            target.capture_layer_ids = list(drafter.config.target_layer_ids)
            self.proposer = DFlashProposer(drafter, num_slots=max_batch_size, capacity=capacity)
        else:
            target.capture_layer_ids = []
        # engines may share one target (a benchmark's modes side by side): each sets what it needs
        self._capture = list(target.capture_layer_ids)
        adaptive = mode == "adaflash" and length_rule == "load_aware"
        posterior = (SurvivalPosterior(max_batch_size, device=self.device, max_block=self.block_size,
                                       idle_decay=idle_decay) if adaptive and calibrate else None)
        if posterior is not None and drafter is not None:  # what the version says it accepts (planner.prior)
            posterior.set_prior(acceptance_prior(drafter.manifest, self.block_size))
        self._draft_off = adaptive and draft_off and posterior is not None
        # plan from history before drafting (needs the draft-off choice, which makes that plan)
        self._plan_first = self._draft_off and lengths_from == "history"
        self.confidence = ConfidenceCalibration() if self._plan_first and confidence_trim else None
        self._min_len = drafter.config.length_head_min_len if drafter is not None else 1
        self.choice = DraftChoice(posterior, self.block_size, self._min_len, self.device,
                                  probe_every=probe_every, probe_share=probe_share, explore=explore, seed=seed)
        # [choice.max_pending, slots, K*H]: a ring of the undrafted rows' target features, one
        # position per step that queued any (see _catch_up and _queue_idle); _ring: the newest
        self._pending: torch.Tensor | None = None
        self._ring = -1
        self._backlog_seconds = 0.0  # time _catch_up spent on queued backlogs, in all (see there)
        self.cost_model = cost_model  # fixed when given; else profiled, then refitted online
        self._online_cost: OnlineCostModel | None = None
        self._cost_warm = False  # the first decode step (a cold one) is not fitted
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = RejectionSampler(self.generator, flashinfer_sampling.available(self.device))
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.solo_admissions = 0  # waiting requests to admit one per step (engine.admission)
        self.stats = EngineStats()
        self._ids = itertools.count()

    # -- admission --------------------------------------------------------------------------
    def submit(self, req: Request) -> RequestOutput | None:
        """Queue a request. An invalid one is answered at once with finish_reason 'error'."""
        index = next(self._ids)
        if req.request_id is None:
            req.request_id = f"req-{index}"
        seq = _Seq(req=req, index=index, stats=RequestStats(self.block_size))
        try:
            self._validate(req)
        except RequestError as e:
            return RequestOutput(req.request_id, list(req.prompt_ids or []), [], "error", seq.stats, str(e), req.domain)
        sp = req.sampling
        if sp.seed is not None and not sp.greedy:
            seq.generator = torch.Generator(device=self.device).manual_seed(sp.seed)
        self.waiting.append(seq)
        return None

    def _validate(self, req: Request) -> None:
        ids = req.prompt_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestError("prompt is empty: send at least one token")
        vocab = self.target.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        req.sampling.validate(vocab)
        need = len(ids) + req.sampling.max_new_tokens
        if need > self.max_seq_len:
            raise RequestError(
                f"prompt of {len(ids)} tokens plus max_new_tokens {req.sampling.max_new_tokens} "
                f"exceeds the engine's max_seq_len {self.max_seq_len}; shorten the prompt or lower max_new_tokens"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request between steps, freeing its slot for the next waiting one.

        A server calls this when its client went away, a stop string matched or a timeout
        passed: otherwise the request would hold a slot until max_new_tokens. Returns the
        request's output so far with finish_reason 'abort', or None when no unfinished request
        has this id. Not thread-safe: call it from the thread that calls step().
        """
        for seq in self.waiting:
            if seq.req.request_id == request_id:
                self.waiting.remove(seq)
                return self._output(seq, "abort")
        for seq in self.running:
            if seq.req.request_id == request_id:
                seq.finish = "abort"
                # between steps only this request is finished, so retiring returns just it
                return self._retire()[0]
        return None

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill), run one decode step, return the newly finished.

        A prefill that raises fails only the request it is blamed on (engine.admission); a
        decode step that raises, or an admission failure no request can be blamed for
        (admission.EngineFailure), propagates: the engine's state is then not to be trusted.
        """
        self.target.capture_layer_ids = self._capture
        finished = admit_waiting(self)
        if self.running:  # running requests never wait for a prefill to finish a whole step
            self._decode_step()
        return finished + self._retire()

    @property
    def posterior(self) -> SurvivalPosterior | None:
        """The calibration state (per-slot and per-domain acceptance evidence), or None.

        The draft-or-not choice holds the one reference, and this reads and replaces it there: a
        second reference on the engine went stale when a caller swapped in a fresh posterior
        (benchmarks/adaptive/run.py resets it before every timed run), and the choice then drafted
        from evidence frozen at the swap while the verifier's evidence went elsewhere.
        `engine.posterior = engine.posterior.fresh()` resets it with the engine's settings.
        """
        return self.choice.posterior

    @posterior.setter
    def posterior(self, posterior: SurvivalPosterior | None) -> None:
        if posterior is None and self._draft_off:
            raise ValueError("this engine decides whom to draft from a posterior (draft-off): assign a fresh "
                             "SurvivalPosterior to reset calibration, not None")
        self.choice.posterior = posterior

    def drafter_swapped(self, manifest: dict | None = None) -> None:
        """A new drafter version serves from the next step on (hot reload, between steps);
        `manifest`: its manifest.json, when the reloader read one.

        The calibration's evidence was about the old version: a domain it failed on would stay
        switched off, read only by probes, however much better the new one is there (the demo's
        math after a round). So every request and domain starts again from what the new version
        says of itself (its manifest's eval, planner.prior; cold, with first reads, for domains
        it does not name), then its own evidence. Requests in flight keep their drafter context
        (computed by the old version; their proposals may suffer, never their output)."""
        if self.drafter is not None:
            self.drafter.manifest = manifest
        if self.posterior is not None:
            self.posterior.forget(acceptance_prior(manifest, self.block_size))
        self.choice.replan()
        if self.confidence is not None:
            self.confidence.reset()
        for seq in self.running:
            seq.probe_gap = 0
            # Its prompt is in the drafter's cache as the old version projected it: the new
            # version's queries would read the old version's keys and values, so its drafts say
            # little about the new version (at worst nothing accepted), and the first ones would
            # be the domain's first evidence. In the closed-loop demo, an in-flight math request
            # whose drafts failed after a swap left math undrafted for 35 requests of a version
            # accepting 3.8 per step. It finishes plain; a row whose context the drafter has not
            # read yet (prompt_feats) is projected by the new version alone and drafts as usual.
            seq.stale_context = seq.prompt_feats is None

    def run(self, requests: list[Request], progress=None) -> list[RequestOutput]:
        """Serve a list of requests to completion; outputs in submission order."""
        by_id = {out.request_id: out for out in self.run_iter(requests, progress)}
        return [by_id[req.request_id] for req in requests]

    def run_iter(self, requests: list[Request], progress=None) -> Iterator[RequestOutput]:
        """Serve a list of requests, yielding each output the moment it is final.

        Refusals come first (submission order), then finished requests in finish order, so a
        caller can hand each one on before the slowest request is done: whatever has finished
        survives an interrupted run.
        """
        refused: list[RequestOutput] = []
        for req in requests:
            out = self.submit(req)  # assigns request_id when missing
            if out is not None:
                refused.append(out)
        ids = [req.request_id for req in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique within one run()")
        for out in refused:
            if progress is not None:
                progress.update(1)
            yield out
        while self.has_unfinished():
            for out in self.step():
                if progress is not None:
                    progress.update(1)
                yield out

    # -- prefill ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self, joined: list[_Seq]) -> None:
        t0 = time.perf_counter()
        offset = len(self.running)
        self.running.extend(joined)
        batch = TargetBatch.from_lists([s.req.prompt_ids for s in joined], [0] * len(joined), self.device, offset)
        last_rows = batch.q_lens.cumsum(0) - 1
        logits, aux = self.target.forward(batch, self.cache, logits_rows=last_rows)
        first = self._sample_rows(logits, joined)
        slots = list(range(offset, offset + len(joined)))
        if self.proposer is not None and aux is not None:
            lazy = [j for j, s in enumerate(joined) if self._lazy_prompt(s, aux.shape[-1])]
            if lazy:  # projected when the request is first drafted (_catch_up), if ever
                rows = aux.split([len(s.req.prompt_ids) for s in joined])  # views of the packed rows
                for j in lazy:
                    joined[j].prompt_feats = rows[j].clone()
            waiting = set(lazy)
            eager = [j for j in range(len(joined)) if j not in waiting]
            if len(eager) == len(joined):
                self.proposer.extend_context(pad_packed(aux, batch), batch.starts, slots)
            elif eager:
                index = torch.tensor(eager, dtype=torch.long, device=self.device)
                feats = pad_packed(aux, batch)
                self.proposer.extend_context(feats[index], batch.starts[index], [slots[j] for j in eager])
        if self.posterior is not None:
            self.posterior.reset(torch.tensor(slots, device=self.device), [s.req.domain for s in joined])
        for seq, tok in zip(joined, first.tolist()):
            seq.cache_len = len(seq.req.prompt_ids)
            self._append(seq, [tok])
        self.stats.prefill_tokens += sum(batch.q_lens_host)
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _lazy_prompt(self, seq: _Seq, width: int) -> bool:
        """Whether a new request's prompt context waits for its first draft. Only where a
        request may never be drafted (draft-off), and only for prompts whose features are
        small to keep (they are held per request until then)."""
        return self._draft_off and len(seq.req.prompt_ids) * width <= _LAZY_PROMPT_ELEMENTS

    def _sample_rows(self, logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        """One token per row from logits [n, V], greedy or filtered sampling per request."""
        out = greedy_ids(logits)
        hot = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]
        if hot:
            probs = filtered_probs(logits[hot], *self._sampling_tensors([seqs[i] for i in hot]))
            out[hot] = self._sample(probs, [seqs[i] for i in hot])
        return out

    def _sampling_tensors(self, seqs: list[_Seq], repeat: int = 1):
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device).repeat_interleave(repeat)

        sp = [s.req.sampling for s in seqs]
        vocab = self.target.vocab_size
        return (
            col([p.temperature for p in sp], torch.float32),
            # top-k beyond the vocabulary keeps all of it, as 0 does; clamped so any int fits a long
            col([min(p.top_k, vocab) for p in sp], torch.long),
            col([p.top_p for p in sp], torch.float32),
        )

    def _row_sampling(self, seqs: list[_Seq]) -> RowSampling:
        temp, top_k, top_p = self._sampling_tensors(seqs)
        return RowSampling(temp, top_k, top_p, [s.generator for s in seqs])

    # -- one speculative step ---------------------------------------------------------------
    @torch.inference_mode()
    def _decode_step(self) -> None:
        """Draft (whom it pays to), verify, accept, commit: one step over the running batch."""
        seqs, t0 = self.running, time.perf_counter()
        spec = self._draft(seqs)
        self._verify_step(seqs, spec, t0, synced_time(self.device))

    def _verify_step(self, seqs: list[_Seq], spec: SpecBatch, t0: float, t1: float) -> None:
        """Verify the step's chains (t0: the step's start, t1: drafting's end), commit, account."""
        # the proposals stay on the device: the verify is queued behind the drafter, not after a read
        lens = spec.lengths.tolist()
        batch = TargetBatch.from_device_ids([s.last_token for s in seqs], spec.draft_ids, lens,
                                            [s.cache_len for s in seqs], self.device)
        logits, aux = self.target.forward(batch, self.cache)
        result = self.sampler.verify(spec, pad_packed(logits, batch))
        committed = result.to_lists()
        self._update_context(seqs, spec, aux, batch, committed)
        self._commit(seqs, spec, committed, result)
        t2 = synced_time(self.device)
        verified = sum(lens)
        self.choice.charge_forced(spec, verified - len(seqs), verify_seconds=t2 - t1)
        self.stats.steps += 1
        self.stats.batch_sizes.append(len(seqs))
        self.stats.verified_tokens += verified
        self.stats.draft_seconds += t1 - t0
        self.stats.verify_seconds += t2 - t1
        if self._online_cost is not None and self._cost_warm:
            # the drafting fit prices a drafted step as steady drafting: without its backlog
            # catch-up (see _catch_up)
            # the drafting fit's per-proposal term is the drafter's LM head: priced by the proposals it
            # computed, which a trim verifies only some of (charged to those, it inflated the price
            # of every verified token the plan buys)
            read = spec.read_proposals if spec.read_proposals is not None else verified - len(seqs)
            self._online_cost.observe(len(seqs), verified, t2 - t0 - spec.draft_seconds, drafted=len(spec.drafted),
                                      draft_seconds=spec.draft_seconds - spec.catch_up_seconds, proposals=read,
                                      multi=sum(1 for n in lens if n > 1))
        # An engine's first decode step pays one-time costs (its buffers, the first kernels at
        # its shapes): on the embedded pair 156 ms against 12, which, fitted, priced a verified
        # token at nothing for the next hundred steps. It is no step's price.
        self._cost_warm = True

    def _draft(self, seqs: list[_Seq]) -> SpecBatch:
        """Choose whom to draft, draft them, choose every verify length, make the proposals;
        name the rows that sample, with their filters, for the verifier."""
        return self._with_sampling(self._draft_rows(seqs), seqs)

    def _with_sampling(self, spec: SpecBatch, seqs: list[_Seq]) -> SpecBatch:
        spec.sampled = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]
        if spec.sampled:
            spec.sampling = self._row_sampling([seqs[i] for i in spec.sampled])
        return spec

    def _draft_rows(self, seqs: list[_Seq]) -> SpecBatch:
        bs = len(seqs)
        if self.proposer is None:
            return SpecBatch.plain(bs, self.device)
        caps = self._draft_caps(seqs)
        drafted, probes = self._choose_drafted(seqs, caps)
        if not drafted:
            return SpecBatch.plain(bs, self.device)
        cap = torch.tensor(caps, dtype=torch.long)
        t0 = time.perf_counter()
        backlog = self._backlog_seconds
        forced_catch_up = self._catch_up_drafted(seqs, drafted, probes)
        backlog = self._backlog_seconds - backlog
        last = torch.tensor([seqs[i].last_token for i in drafted], device=self.device)
        ctx = torch.tensor([seqs[i].cache_len for i in drafted], device=self.device)
        histories = [seqs[i].req.prompt_ids + seqs[i].output for i in drafted]
        spec = SpecBatch(torch.ones(bs, dtype=torch.long), drafted=drafted, probes=probes,
                         forced_catch_up_seconds=forced_catch_up, catch_up_seconds=backlog)
        if self._plan_first:  # lengths first, then only the slots they verify
            self._planned_lengths(spec, cap)
            k = int(spec.lengths.max()) - 1
            # every row reads block slots 1..k: a slice, so the drafter takes them by views
            read_states = self.proposer.propose(last, ctx, histories, slots=drafted, read=slice(1, k + 1))  # [n, K, H]
            hidden = read_states.new_zeros(len(drafted), k + 1, read_states.shape[-1])  # indexed by block slot
            hidden[:, 1:] = read_states
            self._proposals(seqs, spec, hidden, trim=self.confidence is not None)
        else:
            hidden = self.proposer.propose(last, ctx, histories, slots=drafted)  # [n, B, H]
            self._verify_lengths(spec, hidden, cap)
            self._proposals(seqs, spec, hidden)
        spec.draft_seconds = synced_time(self.device) - t0
        return spec

    def _draft_caps(self, seqs: list[_Seq]) -> list[int]:
        """Tokens each row may verify this step: its block or what it has left, 1 (plain) for a
        row whose drafter context is stale (drafter_swapped)."""
        return [1 if s.stale_context else min(self.block_size, s.remaining) for s in seqs]

    def _choose_drafted(self, seqs: list[_Seq], caps: list[int]) -> tuple[list[int], list[int]]:
        """Rows to draft this step and the forced ones among them (draft_choice.DraftChoice)."""
        if not self._draft_off:
            return [i for i, c in enumerate(caps) if c > 1], []
        return self.choice.choose(seqs, caps, self._cost(len(seqs)), measured=self.cost_model is None)

    def _cost(self, batch_size: int) -> StepCostModel:
        if self.cost_model is not None:
            return self.cost_model
        if self._online_cost is None:
            self._online_cost = OnlineCostModel(profile_step_cost(self))
        return self._online_cost.model(batch_size)

    def _generator_of(self, seq: _Seq | None) -> torch.Generator:
        return seq.generator if seq is not None and seq.generator is not None else self.generator

    def _sample(self, probs: torch.Tensor, owners: list[_Seq] | None = None) -> torch.Tensor:
        """One draw per row of probs; owners[j] is row j's request when rows may be seeded."""
        return self.sampler.sample(probs, None if owners is None else [s.generator for s in owners])

    def _commit(self, seqs, spec: SpecBatch, committed, result: VerifyResult) -> None:
        if spec.survival is not None and self.posterior is not None:
            rows = torch.tensor(spec.drafted, dtype=torch.long, device=self.device)
            lens = spec.lengths[spec.drafted].to(self.device)
            self.posterior.observe(rows, spec.head_survival, result.num_accepted[rows], lens)
        if self.posterior is not None:
            self.posterior.idle(len(seqs), spec.drafted)
        if spec.confidence is not None and self.confidence is not None:
            d = spec.drafted
            self.confidence.observe(spec.confidence[d], spec.lengths[d].numpy() - 1,
                                    result.num_accepted[d].cpu().numpy())
        predicted = spec.predicted_ratios(self.block_size, self.mode == "adaflash")
        drafted, probes = set(spec.drafted), set(spec.probes)
        if spec.head_ratio is not None:
            for i, r in zip(spec.drafted, spec.head_ratio.tolist()):
                seqs[i].stats.head_ratios.append(r)
        for i, (seq, toks) in enumerate(zip(seqs, committed)):
            seq.stats.record(int(spec.lengths[i]), len(toks) - 1)
            if predicted is not None:
                seq.stats.predicted_ratios.append(predicted[i])
                seq.stats.drafted.append(i in drafted)
            self._commit_row(seq, toks, drafted=i in drafted, probed=i in probes)

    def _commit_row(self, seq: _Seq, toks: list[int], *, drafted: bool | None, probed: bool) -> None:
        """One row after its verify: its draft-or-not history (drafted None: not tracked), then
        its committed tokens (the bonus token and the accepted proposals before it)."""
        if drafted is not None:
            seq.since_draft = 0 if drafted else seq.since_draft + 1
        if probed:  # a probe that accepted nothing backs the next one off
            seq.probe_gap = self.choice.next_probe_gap(seq.probe_gap, accepted_nothing=len(toks) == 1)
        seq.cache_len += len(toks)  # slot 0 .. last accepted now have committed K/V
        self.stats.committed_tokens += len(toks)
        self._append(seq, toks)

    def _append(self, seq: _Seq, toks: list[int]) -> None:
        """Add committed tokens, honouring stop tokens and max_new_tokens."""
        sp = seq.req.sampling
        for tok in toks:
            seq.output.append(tok)
            if tok in sp.stop_token_ids:
                seq.finish = "stop"
                return
            if len(seq.output) >= sp.max_new_tokens:
                seq.finish = "length"
                return

    # -- retirement -------------------------------------------------------------------------
    @torch.inference_mode()
    def _retire(self) -> list[RequestOutput]:
        """Remove finished requests, moving the last running one into each freed slot."""
        outs = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.finish is None:
                i += 1
                continue
            last = len(self.running) - 1
            mover = self.running[last]
            moved = mover.cache_len
            self.cache.move(last, i, moved)
            if self.proposer is not None:
                # a request that never drafted holds no drafter context yet (its prompt's
                # features wait in prompt_feats): nothing of the drafter's cache is its
                context = 0 if mover.prompt_feats is not None else moved - mover.pending
                self.proposer.move(last, i, context)
                self.proposer.release(last)  # `last` is free now (or i itself retired)
            if self.posterior is not None:
                self.posterior.move(last, i)
            if self._pending is not None and last != i and mover.pending:
                where = self._backlog_positions(self.running, [last], mover.pending)[0]
                self._pending[where, i] = self._pending[where, last]
            self.running[i] = self.running[last]
            self.running.pop()
            outs.append(self._output(seq, seq.finish))
        return outs

    @staticmethod
    def _output(seq: _Seq, finish: str) -> RequestOutput:
        return RequestOutput(seq.req.request_id, list(seq.req.prompt_ids), seq.output, finish, seq.stats, None, seq.req.domain)
