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
from dataclasses import dataclass, field

import torch

from ..drafter.length_head import candidate_lengths
from ..drafter.model import DFlashDrafter
from ..target.hf_target import HFTarget, TargetBatch
from . import flashinfer_sampling
from .length_policy import OnlineCostModel, StepCostModel, choose_verify_lengths
from .proposer import DFlashProposer
from .request import Request, RequestOutput, RequestStats
from .sampling import RequestError, filtered_probs, sample_from
from .verify import VerifyResult, verify_greedy, verify_sampling

MODES = ("ar", "dflash", "adaflash")
LENGTH_RULES = ("load_aware", "paper")


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    verified_tokens: int = 0
    committed_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Seq:
    req: Request
    index: int
    stats: RequestStats
    output: list[int] = field(default_factory=list)
    cache_len: int = 0  # tokens whose K/V (and drafter context) are committed
    finish: str | None = None

    @property
    def last_token(self) -> int:
        return self.output[-1]

    @property
    def remaining(self) -> int:
        return self.req.sampling.max_new_tokens - len(self.output)


class SpecEngine:
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
    ):
        """`proposer` replaces the DFlash proposer (tests, other drafting methods); it must offer
        propose(last, ctx_lens, histories) -> block states [bs, B, H],
        proposal_logits(states, rows, slots) -> [n, V], extend_context and move."""
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
        self.cost_model = cost_model  # fixed when given; else profiled, then refitted online
        self._online_cost: OnlineCostModel | None = None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.use_flashinfer = flashinfer_sampling.available(self.device)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
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
        """Admit waiting requests (prefill), run one decode step, return the newly finished."""
        joined = []
        while self.waiting and len(self.running) + len(joined) < self.max_batch_size:
            joined.append(self.waiting.popleft())
        if joined:
            self._prefill(joined)
            finished = self._retire()  # e.g. max_new_tokens 1, or a stop token first
        else:
            finished = []
        if self.running:  # running requests never wait for a prefill to finish a whole step
            self._decode_step()
        return finished + self._retire()

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
        if self.proposer is not None and aux is not None:
            self.proposer.extend_context(self._pad_rows(aux, batch.q_lens), batch.starts, offset)
        for seq, tok in zip(joined, first.tolist()):
            seq.cache_len = len(seq.req.prompt_ids)
            self._append(seq, [tok])
        self.stats.prefill_tokens += int(batch.q_lens.sum())
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _sample_rows(self, logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        """One token per row from logits [n, V], greedy or filtered sampling per request."""
        out = logits.argmax(-1)
        hot = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]
        if hot:
            probs = filtered_probs(logits[hot], *self._sampling_tensors([seqs[i] for i in hot]))
            out[hot] = self._sample(probs)
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

    @staticmethod
    def _pad_rows(flat: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Packed rows [sum(lens), D] -> padded [n, max(lens), D]."""
        n, width = lens.shape[0], int(lens.max())
        valid = torch.arange(width, device=lens.device)[None] < lens[:, None]
        out = flat.new_zeros(n, width, flat.shape[-1])
        out[valid] = flat
        return out

    # -- one speculative step ---------------------------------------------------------------
    @torch.inference_mode()
    def _decode_step(self) -> None:
        seqs = self.running
        bs = len(seqs)
        last = torch.tensor([s.last_token for s in seqs], device=self.device)
        ctx_lens = torch.tensor([s.cache_len for s in seqs], device=self.device)
        t0 = time.perf_counter()
        hidden = self._draft_states(seqs, last, ctx_lens)  # [bs, B, H] block states, None for ar
        ratio = self.drafter.length_head(hidden) if self.mode == "adaflash" else None
        lengths = self._verify_lengths(seqs, ratio)  # [bs] long, each in [1, B]
        draft_ids, draft_probs = self._proposals(seqs, hidden, lengths)
        t1 = time.perf_counter()
        tokens = [[s.last_token] + draft_ids[i, : lengths[i] - 1].tolist() for i, s in enumerate(seqs)]
        batch = TargetBatch.from_lists(tokens, ctx_lens.tolist(), self.device)
        logits, aux = self.target.forward(batch, self.cache)
        result = self._accept(seqs, draft_ids, draft_probs, self._pad_rows(logits, batch.q_lens), lengths)
        committed = result.to_lists()
        if self.proposer is not None and aux is not None:
            self.proposer.extend_context(
                self._pad_rows(aux, batch.q_lens)[:, : int(result.num_accepted.max()) + 1], ctx_lens
            )
        self._commit(seqs, committed, lengths, ratio)
        self.stats.steps += 1
        self.stats.batch_sizes.append(bs)
        self.stats.verified_tokens += int(batch.q_lens.sum())
        t2 = time.perf_counter()
        self.stats.draft_seconds += t1 - t0
        self.stats.verify_seconds += t2 - t1
        if self._online_cost is not None:
            self._online_cost.observe(bs, int(batch.q_lens.sum()), t2 - t0)

    def _draft_states(self, seqs, last, ctx_lens):
        if self.proposer is None:
            return None
        histories = [s.req.prompt_ids + s.output for s in seqs]
        return self.proposer.propose(last, ctx_lens, histories)

    def _proposals(self, seqs, hidden, lengths):
        """Proposal ids [bs, K] and, for sampled requests, their q [n_hot, K, V], K = max(L) - 1.

        The LM head runs only on the slots each request will verify: the verify lengths are
        chosen from the block states alone, so proposals nobody checks are never computed.
        """
        bs, k = len(seqs), int(lengths.max()) - 1
        draft_ids = torch.zeros(bs, max(k, 0), dtype=torch.long, device=self.device)
        if k <= 0:
            return draft_ids, None
        needed = torch.arange(k)[None] < (lengths - 1)[:, None]  # [bs, K] on the host
        rows, slots = needed.nonzero(as_tuple=True)
        rows_d, slots_d = rows.to(self.device), slots.to(self.device)
        logits = self.proposer.proposal_logits(hidden, rows_d, slots_d + 1)  # [n, V]
        draft_ids[rows_d, slots_d] = logits.argmax(-1)
        hot = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]
        if not hot:
            return draft_ids, None
        hot_index = torch.full((bs,), -1, dtype=torch.long)
        hot_index[hot] = torch.arange(len(hot))
        sel = hot_index[rows] >= 0
        temp, top_k, top_p = self._sampling_tensors(seqs)
        rs = rows_d[sel.to(self.device)]
        q = filtered_probs(logits[sel.to(self.device)], temp[rs], top_k[rs], top_p[rs])
        draft_ids[rs, slots_d[sel.to(self.device)]] = self._sample(q)
        draft_probs = q.new_zeros(len(hot), k, q.shape[-1])
        draft_probs[hot_index[rows[sel]].to(self.device), slots_d[sel.to(self.device)]] = q
        return draft_ids, draft_probs

    def _verify_lengths(self, seqs, ratio) -> torch.Tensor:
        cap = torch.tensor([min(self.block_size, s.remaining) for s in seqs], dtype=torch.long)
        if self.mode == "ar":
            return torch.ones(len(seqs), dtype=torch.long)
        if self.mode == "dflash":
            return cap
        cfg = self.drafter.config
        if self.length_rule == "paper":
            lengths = candidate_lengths(ratio.cpu(), self.block_size, cfg.length_head_rate, cfg.length_head_min_len)
            return torch.minimum(lengths, cap)
        cost = self.cost_model or self._learned_cost(len(seqs))
        return choose_verify_lengths(ratio.cpu(), self.block_size, cost, min_len=cfg.length_head_min_len, max_len=cap)

    def _learned_cost(self, batch_size: int) -> StepCostModel:
        if self._online_cost is None:
            self._online_cost = OnlineCostModel(profile_step_cost(self))
        return self._online_cost.model(batch_size)

    def _accept(self, seqs, draft_ids, draft_probs, target_logits, lengths) -> VerifyResult:
        """Greedy rows by matching, sampled rows by rejection sampling; one result for all."""
        k = target_logits.shape[1] - 1
        draft_ids = draft_ids[:, :k]
        num_candidates = (lengths - 1).to(self.device)
        result = verify_greedy(draft_ids, target_logits, num_candidates)
        hot = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]
        if hot:
            hot_seqs = [seqs[i] for i in hot]
            p = filtered_probs(target_logits[hot].flatten(0, 1), *self._sampling_tensors(hot_seqs, k + 1))
            q = draft_probs[:, :k] if draft_probs is not None else p.new_zeros(len(hot), 0, p.shape[-1])
            sampled = self._verify_sampled(draft_ids[hot], q, p.view(len(hot), k + 1, -1), num_candidates[hot])
            result.tokens[hot] = sampled.tokens
            result.num_accepted[hot] = sampled.num_accepted
        return result

    def _verify_sampled(self, draft_ids, q, p, num_candidates) -> VerifyResult:
        n = num_candidates[0]
        if self.use_flashinfer and q.shape[1] > 0 and bool((num_candidates == n).all()):  # syncs once
            return flashinfer_sampling.verify_sampling_uniform(draft_ids, q, p, int(n), self.generator)
        return verify_sampling(draft_ids, q, p, num_candidates, self.generator)

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        if self.use_flashinfer:
            return flashinfer_sampling.sample(probs, self.generator)
        return sample_from(probs, self.generator)

    def _commit(self, seqs, committed, lengths, ratio) -> None:
        for i, (seq, toks) in enumerate(zip(seqs, committed)):
            seq.stats.record(int(lengths[i]), len(toks) - 1)
            if ratio is not None:
                seq.stats.predicted_ratios.append(float(ratio[i]))
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
            moved = self.running[last].cache_len
            self.cache.move(last, i, moved)
            if self.proposer is not None:
                self.proposer.move(last, i, moved)
            self.running[i] = self.running[last]
            self.running.pop()
            outs.append(self._output(seq, seq.finish))
        return outs

    @staticmethod
    def _output(seq: _Seq, finish: str) -> RequestOutput:
        return RequestOutput(seq.req.request_id, list(seq.req.prompt_ids), seq.output, finish, seq.stats, None, seq.req.domain)


def kv_cache_bytes(target: HFTarget, drafter: DFlashDrafter | None, *, mode: str, max_batch_size: int, max_seq_len: int) -> int:
    """What SpecEngine(...) with these settings allocates for its slot caches, up front.

    The caches are allocated whole at construction, so a caller can refuse settings that would
    not fit before torch tries (and the machine swaps or the process is killed).
    """
    capacity = max_seq_len + (drafter.config.block_size if drafter is not None else 1) + 1  # as __init__

    def cache(layers, kv_heads, head_dim, dtype) -> int:
        return 2 * layers * max_batch_size * kv_heads * capacity * head_dim * dtype.itemsize

    total = cache(target.num_layers, target.config.num_key_value_heads, target.head_dim, target.dtype)
    if mode != "ar" and drafter is not None:
        cfg = drafter.config
        total += cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, drafter.fc.weight.dtype)
    return total


def profile_step_cost(engine: SpecEngine, sizes=(16, 128), repeats: int = 2) -> StepCostModel:
    """Fit time = fixed + per_token * T for a ragged verify forward (plus one drafter forward).

    Runs on spare cache slots' worth of scratch data; called once, lazily, by adaflash mode.
    """
    target = engine.target
    scratch = target.new_cache(1, max(sizes) + 1)
    times = []
    for t in sizes:
        ids = torch.zeros(1, t, dtype=torch.long, device=engine.device)
        batch = TargetBatch(ids, torch.zeros(1, dtype=torch.long, device=engine.device), torch.tensor([t], device=engine.device))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            target.forward(batch, scratch)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    per_token = max((times[1] - times[0]) / (sizes[1] - sizes[0]), 1e-9)
    fixed = max(times[0] - per_token * sizes[0], 0.0)
    if isinstance(engine.proposer, DFlashProposer):
        # drafting the block costs the same whatever the lengths; its LM head runs per proposal
        zero = torch.zeros(1, dtype=torch.long, device=engine.device)
        t0 = time.perf_counter()
        hidden = engine.proposer.propose(zero, zero, None)
        fixed += time.perf_counter() - t0
        head_times = []
        for n in (4, 64):
            rows = torch.zeros(n, dtype=torch.long, device=engine.device)
            t0 = time.perf_counter()
            engine.proposer.proposal_logits(hidden, rows, rows + 1)
            head_times.append(time.perf_counter() - t0)
        per_token += max((head_times[1] - head_times[0]) / 60, 0.0)
    return StepCostModel(fixed=fixed, per_token=per_token)
