"""From the drafter's block states to the target's verify work, for one decode step.

    draft hidden [bs*B, H] --length head--> ratio [bs]
        --the shared planner (sglang_adaflash.planner: load-aware or paper rule, the same code
          the reference engine runs, on the device)--> verify lengths L [bs]
        --SGLang RaggedVerifyLayout--> packed (compact) verify of sum(L) tokens
        --SGLang ScatterCompactToStrided--> logits / hidden back to [bs*B] for DFlash's accept
        --cap_candidates--> acceptance stops at L_i - 1 proposals

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
from sglang_adaflash.planner.lengths import LENGTH_RULES
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

    @classmethod
    def of(cls, block_size: int, verify_lens: Sequence[int], ratio: torch.Tensor | None,
           reason: str) -> VerifyPlan:
        return cls(torch.tensor([int(n) for n in verify_lens], dtype=torch.long),
                   block_size=block_size, ratio=ratio, reason=reason)

    @property
    def verify_lens_cpu(self) -> list[int]:
        """[bs] L_i in [1, B], slot 0 included (SGLang's ragged layout takes a list)."""
        return self.lengths.tolist()

    @property
    def bs(self) -> int:
        return self.batch_size

    @property
    def num_verify_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def is_uniform(self) -> bool:
        return bool((self.lengths == self.block_size).all())

    @classmethod
    def uniform(cls, bs: int, block_size: int, reason: str) -> VerifyPlan:
        return cls.of(block_size, [block_size] * bs, None, reason)

    @classmethod
    def from_lists(cls, verify_lens: Sequence[int], block_size: int) -> VerifyPlan:
        """A plan from plain lists (tests, warm-up); checks the bounds."""
        lens = [int(n) for n in verify_lens]
        bad = [n for n in lens if not 1 <= n <= block_size]
        if bad:
            raise ValueError(f"verify lengths must lie in [1, {block_size}], found {bad}")
        return cls.of(block_size, lens, None, "given")


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
    max_len: Sequence[int] | None = None,
) -> list[int]:
    """ratio [bs] -> verify lengths [bs], by the reference engine's own planner:

    - ``load_aware`` (default): :func:`sglang_adaflash.planner.lengths.plan_lengths`, which keeps
      the verify slots worth their cost for this batch size (every request here is drafted);
    - ``paper``: AdaFlash's ``clamp(round(ratio * B * rate), min_len, B)``.

    ``max_len`` [bs] caps each request (e.g. the tokens it may still generate). The planner runs
    on ratio's device without synchronising; the one copy to the host is SGLang's ragged layout
    needing the lengths there.
    """
    if rule not in LENGTH_RULES:
        raise ValueError(f"length rule must be one of {LENGTH_RULES}, found {rule!r}")
    cap = None
    if max_len is not None:
        cap = torch.tensor(list(max_len), dtype=torch.long).clamp(1, block_size).to(ratio.device, non_blocking=True)
    lens = shared_plan(
        ratio.detach().float(),
        block_size,
        rule=rule,
        cost=cost.plan_cost() if cost is not None and rule == "load_aware" else None,
        rate=rate,
        min_len=min_len,
        cap=cap,
    )
    return [int(n) for n in lens.tolist()]


def cap_candidates(candidates: torch.Tensor, verify_lens: torch.Tensor) -> torch.Tensor:
    """Candidates [bs, B] with slots >= L_i replaced by :data:`NEVER_ACCEPTED` (a copy).

    Greedy acceptance compares proposal k with the target's token at slot k - 1, so proposal
    L_i is never accepted and the bonus comes from slot <= L_i - 1, which was verified.
    """
    bs, block = candidates.shape
    slots = torch.arange(block, device=candidates.device)[None, :]  # [1, B]
    keep = slots < verify_lens.to(candidates.device).view(bs, 1)  # [bs, B]
    return torch.where(keep, candidates, torch.full_like(candidates, NEVER_ACCEPTED))


def build_layout(plan: VerifyPlan, *, device, model_runner=None):
    """SGLang's RaggedVerifyLayout for a plan, rounded up to the captured token buckets."""
    from sglang.srt.speculative.dspark_components.dspark_planner import verify_layout_grid
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout, RaggedVerifyMode

    if model_runner is None:
        grid = [plan.num_verify_tokens]
    else:
        grid = verify_layout_grid(
            verify_lens_cpu=plan.verify_lens_cpu,
            ragged_verify_mode=RaggedVerifyMode.COMPACT,
            model_runner=model_runner,
        )
        if plan.num_verify_tokens > grid[-1]:
            # More tokens than the largest captured graph (a batch above the captured batch
            # sizes): no bucket fits, the verify runs eagerly on exactly these tokens.
            grid = [plan.num_verify_tokens]
    return RaggedVerifyLayout.from_verify_lens(
        verify_lens_cpu=plan.verify_lens_cpu, device=device, grid=grid
    )


class ScatterBuffer:
    """A reusable output of the scatter-back, so a step does not allocate a fresh
    ``[bs*B, vocab]`` logits tensor; it grows to the largest batch seen, never shrinks."""

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
    ) -> VerifyPlan:
        if not greedy:
            # Capping a rejection-sampling step must draw the bonus from the target's filtered
            # distribution at slot L_i - 1, which SGLang computes inside its sampling kernel;
            # until that is wired, sampled batches verify whole blocks (still lossless).
            return VerifyPlan.uniform(bs, self.block_size, "sampling")
        if self.head is None or draft_hidden is None:
            return VerifyPlan.uniform(bs, self.block_size, "uniform")
        ratio = head_ratio(self.head, draft_hidden, bs, self.block_size)
        lens = plan_verify_lengths(
            ratio,
            self.block_size,
            rate=self.rate,
            min_len=self.min_len,
            cost=self.cost,
            rule=self.rule,
            max_len=max_len,
        )
        return VerifyPlan.of(self.block_size, lens, ratio, "head")
