"""From the drafter's block states to the target's verify work, for one decode step.

    draft hidden [bs*B, H] --length head--> ratio [bs]
        --the shared planner (sglang_adaflash.planner: load-aware or paper rule, the same code
          the reference engine runs, on the device)--> verify lengths L [bs]
        --SGLang RaggedVerifyLayout--> packed (compact) verify of sum(L) tokens
        --SGLang ScatterCompactToStrided--> the target's tokens (greedy) or logits, and the
          hidden states, back to [bs*B] for DFlash's accept
        --cap_candidates--> acceptance stops at L_i - 1 proposals

No host synchronisation: the host must know how many tokens the target verifies before it
launches anything (the CUDA-graph bucket, the packed batch's size), but not how they are split
among requests. So the host decides the step's *total* from what it already knows (each
request's remaining tokens, the batch size) and the previous step's plan, read through a pinned,
non-blocking copy (:class:`LaggedMean`; the GPU has long finished it); the device splits that
total among the requests by this step's length head (:func:`fit_to_total`), so the lengths
themselves never leave the device inside a step.

Vocabulary as in ``sglang_adaflash.serving.metrics``: the verify (candidate) length ``L`` counts
block slots the target verifies, slot 0 (the last committed token) included.

Everything here is a function of tensors and lists, so it runs on CPU in tests against SGLang's
own torch reference implementations; :class:`VerifyPlanner` only holds the head and options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_adaflash.core.spec_metadata import SpecMetadata
from sglang_adaflash.drafter.length_head import AdaptiveLengthHead
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.planner.lengths import LENGTH_RULES, survival_rate
from sglang_adaflash.planner.lengths import plan_verify_lengths as shared_plan

#: A token id no target can predict: capped slots hold it so greedy acceptance stops there.
NEVER_ACCEPTED = -1


@dataclass
class VerifyPlan(SpecMetadata):
    """The verify lengths of one step: the core's step contract (``SpecMetadata``, the same
    type the reference engine drafts into), with what the plugin adds. SGLang keeps the
    proposals and does the accepting, so ``draft_ids``/``draft_probs`` stay empty here and
    ``lengths`` is all that passes from drafting to verification."""

    block_size: int = 0  # B
    ratio: torch.Tensor | None = None  # [bs] float, the head's E[tau]/B (None: head not used)
    reason: str = "head"  # why these lengths: head | uniform (no head output) | sampling
    # [bs] long: what the length rule chose before the step's total was applied (feeds the
    # next step's total); None = the lengths themselves
    rule_lengths: torch.Tensor | None = None
    # sum(lengths) when the host knows it without reading the device (a budgeted step)
    total_host: int | None = None

    @classmethod
    def of(cls, block_size: int, verify_lens: Sequence[int], ratio: torch.Tensor | None,
           reason: str) -> VerifyPlan:
        return cls(torch.tensor([int(n) for n in verify_lens], dtype=torch.long),
                   block_size=block_size, ratio=ratio, reason=reason)

    @property
    def verify_lens_cpu(self) -> list[int]:
        """[bs] L_i in [1, B], slot 0 included. Reads the device: tests and logging only,
        never inside a decode step."""
        return self.lengths.tolist()

    @property
    def bs(self) -> int:
        return self.batch_size

    @property
    def num_verify_tokens(self) -> int:
        """sum(L): the host's own count when it has one, else read from the device."""
        return self.total_host if self.total_host is not None else int(self.lengths.sum())

    @property
    def is_uniform(self) -> bool:
        """Whole blocks for every request; decided on the host (no device read)."""
        return self.reason in ("uniform", "sampling", "given-uniform")

    @classmethod
    def uniform(cls, bs: int, block_size: int, reason: str, device=None) -> VerifyPlan:
        lens = torch.full((bs,), block_size, dtype=torch.long, device=device)
        return cls(lens, block_size=block_size, reason=reason, total_host=bs * block_size)

    @classmethod
    def from_lists(cls, verify_lens: Sequence[int], block_size: int) -> VerifyPlan:
        """A plan from plain lists (tests, warm-up); checks the bounds."""
        lens = [int(n) for n in verify_lens]
        bad = [n for n in lens if not 1 <= n <= block_size]
        if bad:
            raise ValueError(f"verify lengths must lie in [1, {block_size}], found {bad}")
        plan = cls.of(block_size, lens, None, "given")
        plan.total_host = sum(lens)
        if all(n == block_size for n in lens):
            plan.reason = "given-uniform"
        return plan


def head_ratio(head: AdaptiveLengthHead, draft_hidden: torch.Tensor, bs: int, block_size: int):
    """The length head on the drafter's final normed block states: [bs*B, H] -> ratio [bs]."""
    hidden = draft_hidden.reshape(bs, block_size, -1)  # [bs, B, H]
    with torch.inference_mode():
        return head(hidden)


def plan_verify_lengths(
    ratio: torch.Tensor,
    block_size: int,
    *,
    rate: float,
    min_len: int,
    cost: StepCostModel | None,
    rule: str = "load_aware",
    max_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """ratio [bs] -> verify lengths [bs] long on ratio's device, by the reference engine's
    own planner:

    - ``load_aware`` (default): :func:`sglang_adaflash.planner.lengths.plan_lengths`, which keeps
      the verify slots worth their cost for this batch size (every request here is drafted);
    - ``paper``: AdaFlash's ``clamp(round(ratio * B * rate), min_len, B)``.

    ``max_len`` [bs] (on ratio's device) caps each request (e.g. the tokens it may still
    generate). Nothing here reads the device.
    """
    if rule not in LENGTH_RULES:
        raise ValueError(f"length rule must be one of {LENGTH_RULES}, found {rule!r}")
    cap = None if max_len is None else max_len.clamp(1, block_size)
    return shared_plan(
        ratio.detach().float(),
        block_size,
        rule=rule,
        cost=cost.plan_cost() if cost is not None and rule == "load_aware" else None,
        rate=rate,
        min_len=min_len,
        cap=cap,
    )


def cap_candidates(candidates: torch.Tensor, verify_lens: torch.Tensor) -> torch.Tensor:
    """Candidates [bs, B] with slots >= L_i replaced by :data:`NEVER_ACCEPTED` (a copy).

    Greedy acceptance compares proposal k with the target's token at slot k - 1, so proposal
    L_i is never accepted and the bonus comes from slot <= L_i - 1, which was verified.
    """
    bs, block = candidates.shape
    slots = torch.arange(block, device=candidates.device)[None, :]  # [1, B]
    keep = slots < verify_lens.to(candidates.device).view(bs, 1)  # [bs, B]
    return torch.where(keep, candidates, torch.full_like(candidates, NEVER_ACCEPTED))


@dataclass(frozen=True)
class HostBudget:
    """What the host decides for one step before the drafter runs, from host values only."""

    lo: list[int]  # [bs] fewest slots each request verifies: min(min_len, cap_i); B if sampled
    cap: list[int]  # [bs] most slots: min(B, tokens the request may still generate)
    total: int  # sum(L): exactly this many tokens are verified, lo <= L <= cap
    graph_num_tokens: int  # the packed verify's size: total rounded up to a captured bucket

    @property
    def bs(self) -> int:
        return len(self.cap)


def capture_grid(model_runner) -> tuple[list[int] | None, int | None]:
    """(token buckets, most slots) of the target's compact verify graphs, None when eager."""
    runner = getattr(model_runner, "decode_cuda_graph_runner", None)
    if runner is None or not getattr(runner, "ragged_verify_mode", False):
        return None, None
    backend = getattr(model_runner, "attn_backend", None)
    if backend is not None and not getattr(backend, "supports_ragged_verify_graph", True):
        return None, None  # its verify runs eagerly: a bucket's spare tokens would be paid
    return list(runner.capture_num_tokens), getattr(runner, "max_bs", None)


def plan_host_budget(
    *,
    block_size: int,
    min_len: int,
    remaining: Sequence[int] | None,
    bs: int,
    mean_len: float,
    sampled: Sequence[bool] | None = None,
    grid: Sequence[int] | None = None,
    max_slots: int | None = None,
) -> HostBudget:
    """The step's total verify tokens: the previous step's mean rule length times the batch
    size, within what the requests allow, rounded up to a CUDA-graph bucket (whose spare tokens
    are verified too: they cost nothing once the bucket is launched).

    ``remaining`` [bs]: tokens each request may still generate (None: unknown, B);
    ``sampled`` [bs]: requests that must verify whole blocks.
    """
    cap = [block_size] * bs if remaining is None else [max(1, min(block_size, int(r))) for r in remaining]
    lo = [min(min_len, c) for c in cap]
    if sampled is not None:
        lo = [c if s else n for n, c, s in zip(lo, cap, sampled)]
    want = max(sum(lo), min(sum(cap), round(mean_len * bs)))
    graph = want
    if grid and (max_slots is None or bs <= max_slots) and want <= grid[-1]:
        graph = next(t for t in sorted(grid) if t >= want)
    return HostBudget(lo=lo, cap=cap, total=min(graph, sum(cap)), graph_num_tokens=graph)


def fit_to_total(
    survival: torch.Tensor, lo: torch.Tensor, cap: torch.Tensor, total: int, block_size: int
) -> torch.Tensor:
    """Split ``total`` verify slots among the requests: every request gets its ``lo`` slots,
    the rest go to the slots most likely to be accepted (slot s of request i survives with
    probability a_i^s, decreasing in s, so each request's share is a prefix). Device only:
    ``total`` is a host int and sum(cap) >= total >= sum(lo) (see :func:`plan_host_budget`).

    survival, lo, cap: [bs] -> lengths [bs] long with lo <= L <= cap and sum(L) == total.
    """
    bs = survival.shape[0]
    slots = torch.arange(block_size, device=survival.device)  # [B]
    value = survival.float().clamp(0, 1)[:, None].pow(slots[None].float())  # [bs, B] a^s
    value = torch.where(slots[None] < lo[:, None], torch.full_like(value, 2.0), value)
    value = torch.where(slots[None] >= cap[:, None], torch.full_like(value, -1.0), value)
    chosen = torch.topk(value.reshape(-1), total, sorted=False).indices  # [total]
    lens = torch.zeros(bs, dtype=torch.long, device=survival.device)
    return lens.scatter_add_(0, chosen // block_size, torch.ones_like(chosen))


def verify_layout(
    lengths: torch.Tensor, *, total: int, graph_num_tokens: int, caps: Sequence[int] | None = None
):
    """SGLang's RaggedVerifyLayout from device lengths and the host's counts (no host read).

    ``caps`` [bs] (host): the most each request may verify; they ride along as the layout's
    host ``qo_indptr`` (their prefix sums), which is what FlashInfer plans from
    (``flashinfer_verify``)."""
    import msgspec
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

    layout = RaggedVerifyLayout.from_verify_lens_device(
        verify_lens=lengths, graph_num_tokens=graph_num_tokens
    )
    host_qo = None
    if caps is not None:
        host_qo = torch.zeros(len(caps) + 1, dtype=torch.int32)
        host_qo[1:] = torch.cumsum(torch.tensor(list(caps), dtype=torch.int32), 0)
    # FlashInfer and Triton size their KV index buffers by the token count: give it.
    return msgspec.structs.replace(layout, total_verify_tokens=total, qo_indptr_host=host_qo)


class LaggedMean:
    """The previous step's mean rule length per request, read on the host without waiting.

    Each step queues a copy of its rule lengths' mean into pinned host memory behind the
    step's own kernels; a later step reads it once the copy has landed (an event says so) and
    keeps the last landed value until then. On a CPU the copy is immediate."""

    def __init__(self, default: float):
        self.value = float(default)
        self._pending: list[tuple[torch.Tensor, object]] = []

    def push(self, lengths: torch.Tensor) -> None:
        mean = lengths.float().mean().reshape(1)
        if mean.is_cuda:
            host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            host.copy_(mean, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event))
        else:
            self._pending.append((mean, None))

    def read(self) -> float:
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            host, _ = self._pending.pop(0)
            self.value = float(host[0])  # landed in host memory: no device wait
        del self._pending[:-4]  # a stalled device never grows this
        return self.value


class ScatterBuffer:
    """A reusable output of the scatter-back (target tokens, hidden states, and the logits of
    the steps that need them: logprobs, grammar, penalties), so a step does not allocate a
    fresh one; it grows to the largest batch seen, never shrinks."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def rows(self, n: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buf
        if (
            buf is None
            or buf.shape[0] < n
            or buf.shape[1:] != like.shape[1:]
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = self._buf = torch.empty((n, *like.shape[1:]), dtype=like.dtype, device=like.device)
        return buf[:n]

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._buf


def no_logits(rows: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    """A [rows, vocab] stand-in for the strided verify logits of a greedy compact step, with no
    memory of its own (one element, stride 0): DFlash's step only checks its shape there,
    because its acceptance takes the target's tokens instead (``target_predict``). Anything
    that writes into it fails loudly (an expanded tensor refuses in-place writes).

    This is what keeps a ``[bs*B, V]`` float32 buffer (0.47 GB for Qwen3-8B at bs 48) out of
    the step: only the target's own packed ``[sum(L), V]`` logits, inside SGLang's memory
    plan, and a ``[bs*B]`` token buffer remain."""
    return like.new_zeros(()).expand(rows, vocab)


def scatter_to_strided(
    compact: torch.Tensor, layout, block_size: int, out: ScatterBuffer | None = None
) -> torch.Tensor:
    """Packed rows [T_graph, D] -> [bs*B, D]; unverified slots are zero (never committed).

    With ``out``, SGLang's Triton path writes into that buffer; its torch reference path (CPU
    inputs, as SGLang dispatches) allocates as it always does.
    """
    from sglang.kernels.ops.speculative.dspark import dspark_verify_window as W

    if out is not None and W.inputs_on_cuda(compact):
        rows = out.rows(layout.verify_lens.shape[0] * block_size, compact)
        return W.scatter_compact_to_strided_into(
            compact=compact,
            verify_lens=layout.verify_lens.to(device=compact.device),
            out=rows,
            stride=block_size,
            fill_value=0.0,
        )
    return W.ScatterCompactToStrided.execute(
        compact=compact, layout=layout, fill_value=0.0, verify_num_draft_tokens=block_size
    )


class VerifyPlanner:
    """Holds the length head and the options; turns draft states into a :class:`VerifyPlan`."""

    def __init__(
        self,
        head: AdaptiveLengthHead | None,
        block_size: int,
        *,
        rate: float,
        min_len: int,
        cost: StepCostModel | None,
        rule: str = "load_aware",
    ):
        if rule not in LENGTH_RULES:
            raise ValueError(f"length rule must be one of {LENGTH_RULES}, found {rule!r}")
        self.head = head
        self.block_size = block_size
        self.rate = rate
        self.min_len = min(min_len, block_size)
        self.cost = cost
        self.rule = rule

    def plan(
        self,
        draft_hidden: torch.Tensor | None,
        bs: int,
        *,
        greedy: bool,
        max_len: Sequence[int] | None = None,
        budget: HostBudget | None = None,
    ) -> VerifyPlan:
        """This step's lengths, on the draft states' device, without reading it.

        ``budget`` (compact mode): the host's total for the step; the rule's lengths are then
        refitted to exactly ``budget.total`` slots (:func:`fit_to_total`). Without it (cap
        mode) the rule's lengths are used as they are, capped by ``max_len``.
        """
        device = draft_hidden.device if draft_hidden is not None else None
        if not greedy:
            # Capping a rejection-sampling step must draw the bonus from the target's filtered
            # distribution at slot L_i - 1, which SGLang computes inside its sampling kernel;
            # sampled batches verify whole blocks (still lossless; docs/sglang.md says why
            # the greedy rows of a mixed batch are not compacted either).
            return VerifyPlan.uniform(bs, self.block_size, "sampling", device)
        if self.head is None or draft_hidden is None:
            return VerifyPlan.uniform(bs, self.block_size, "uniform", device)
        ratio = head_ratio(self.head, draft_hidden, bs, self.block_size)
        if budget is not None:
            lo, cap = host_to_device([budget.lo, budget.cap], ratio.device)
        else:
            cap = None if max_len is None else host_to_device([list(max_len)], ratio.device)[0]
        rule = plan_verify_lengths(
            ratio,
            self.block_size,
            rate=self.rate,
            min_len=self.min_len,
            cost=self.cost,
            rule=self.rule,
            max_len=cap,
        )
        if budget is None:
            return VerifyPlan(rule, block_size=self.block_size, ratio=ratio, reason="head")
        lens = fit_to_total(
            survival_rate(ratio, self.block_size), lo, cap, budget.total, self.block_size
        )
        return VerifyPlan(
            lens, block_size=self.block_size, ratio=ratio, reason="head", rule_lengths=rule,
            total_host=budget.total,
        )  # fmt: skip


def host_to_device(rows: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Host integer lists -> a [len(rows), n] long tensor on ``device``, staged in pinned
    memory so the copy is queued on the stream instead of waiting for it (a pageable copy,
    or ``torch.tensor(..., device=cuda)``, would wait for every kernel queued before it)."""
    pin = torch.device(device).type == "cuda"
    host = torch.tensor([list(r) for r in rows], dtype=torch.long, pin_memory=pin)
    return host.to(device, non_blocking=pin)
