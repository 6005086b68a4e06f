"""A drafted step's verify lengths and proposals: from the length head's reading of the block or
the plan made before drafting, then the drafter's LM head on the slots verified, and the
optional confidence trim.

A mixin of SpecEngine (engine.engine), which owns the state it reads: `mode`, `drafter`,
`proposer`, `posterior`, `choice`, `confidence`, `length_rule`, `block_size`, `device`,
`cost_model`, `stats` and its `_cost`, `_sample` and `_sampling_tensors`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.sampling import filtered_probs, greedy_ids
from ..planner.confidence import trim_lengths
from ..planner.lengths import PlanCost, plan_verify_lengths, survival_rate
from .step_state import SpecBatch, _Seq


class DraftedRows:
    def _verify_lengths(self, spec: SpecBatch, hidden: torch.Tensor, cap: torch.Tensor) -> None:
        """Verify lengths for the drafted rows (the others keep 1), from the head when adaptive."""
        rows = torch.tensor(spec.drafted, dtype=torch.long)
        if self.mode == "dflash":
            spec.lengths[rows] = cap[rows]
            return
        ratio = self.drafter.length_head(hidden)  # [n]
        spec.head_ratio = ratio
        if self.length_rule == "paper":
            cfg = self.drafter.config
            lens = plan_verify_lengths(ratio, self.block_size, rule="paper", rate=cfg.length_head_rate,
                                       min_len=cfg.length_head_min_len, cap=cap[rows].to(ratio.device))
            spec.lengths[rows] = lens.cpu()
            return
        head = survival_rate(ratio, self.block_size)
        slots = rows.to(self.device)
        spec.head_survival = head
        spec.survival = self.posterior.calibrate(slots, head) if self.posterior is not None else head
        # the drafts are paid for now: price the step with them, every row in it
        bs, n = len(spec.lengths), len(spec.drafted)
        cost = self._cost(bs)
        sunk = PlanCost(cost.fixed + cost.draft_fixed + cost.per_draft * n, cost.per_token,
                        per_proposal=cost.per_proposal)
        survival = torch.zeros(bs, device=self.device)
        survival[slots] = spec.survival.float()
        row_cap = torch.ones(bs, dtype=torch.long)
        row_cap[rows] = cap[rows]
        allow_off = torch.zeros(bs, dtype=torch.bool)
        if self._draft_off:
            allow_off[rows] = True
            # a probe (or a first read) verifies one proposal, or min_len - 1: evidence, cheaply.
            # Verified whole, a wave of new requests read at once costs ten plain steps at c=64
            allow_off[spec.probes] = False
            row_cap[spec.probes] = cap[spec.probes].clamp(max=max(self._min_len, 2))
        full_ratio = torch.zeros(bs, device=self.device)
        full_ratio[slots] = ratio.float()
        lens = plan_verify_lengths(full_ratio, self.block_size, rule="load_aware", cost=sunk, min_len=self._min_len,
                                   cap=row_cap.to(self.device), survival=survival, allow_off=allow_off.to(self.device))
        spec.lengths = lens.cpu()

    def _planned_lengths(self, spec: SpecBatch, cap: torch.Tensor) -> None:
        """Verify lengths from the draft-or-not plan the choice just made from each request's
        history (lengths_from="history"): a planned row verifies its planned length, a forced
        one (first read, probe) max(min_len, 2) slots, as in _verify_lengths."""
        rows = torch.tensor(spec.drafted, dtype=torch.long)
        planned = self.choice.lengths[rows]
        forced = cap[rows].clamp(max=max(self._min_len, 2))
        spec.lengths[rows] = torch.where(planned > 1, planned, forced).clamp(max=cap[rows])
        # the plan's survival stands where the head's would: the posterior learns from history alone
        spec.survival = spec.head_survival = self.choice.rate[rows.to(self.device)].float()

    def _proposals(self, seqs: list[_Seq], spec: SpecBatch, hidden: torch.Tensor, trim: bool = False) -> None:
        """Proposal ids [bs, K] and, for sampled requests, their q [n_hot, K, V], K = max(L) - 1.

        The LM head runs only on the slots each request will verify: the verify lengths are
        chosen from the block states alone, so proposals nobody checks are never computed.
        With `trim`, the planned lengths are then cut where the proposals' own probabilities
        say they will mostly be rejected (_trim): the LM head ran on the slots cut, since their
        probabilities are what decides the cut. hidden [n, >= K+1, H] is indexed by block slot.
        """
        bs, k = len(seqs), int(spec.lengths.max()) - 1
        spec.draft_ids = torch.zeros(bs, max(k, 0), dtype=torch.long, device=self.device)
        sampled = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]
        if k <= 0:
            return
        in_hidden = torch.full((bs,), -1, dtype=torch.long)
        in_hidden[spec.drafted] = torch.arange(len(spec.drafted))
        needed = torch.arange(k)[None] < (spec.lengths - 1)[:, None]  # [bs, K] on the host
        rows, slots = needed.nonzero(as_tuple=True)
        rows_d, slots_d = rows.to(self.device), slots.to(self.device)
        logits = self.proposer.proposal_logits(hidden, in_hidden[rows].to(self.device), slots_d + 1)  # [n, V]
        spec.draft_ids[rows_d, slots_d] = greedy_ids(logits)
        if trim:
            self._trim(spec, rows, slots, logits, k)
            k = int(spec.lengths.max()) - 1
            spec.draft_ids = spec.draft_ids[:, : max(k, 0)]
            if k <= 0:
                return
        if not sampled:
            return
        hot_index = torch.full((bs,), -1, dtype=torch.long)
        hot_index[sampled] = torch.arange(len(sampled))
        sel = (hot_index[rows] >= 0) & (slots < k)  # slots the trim left to verify
        sel_d = sel.to(self.device)
        temp, top_k, top_p = self._sampling_tensors(seqs)
        rs = rows_d[sel_d]
        q = filtered_probs(logits[sel_d], temp[rs], top_k[rs], top_p[rs])
        spec.draft_ids[rs, slots_d[sel_d]] = self._sample(q, [seqs[i] for i in rows[sel].tolist()])
        spec.draft_probs = q.new_zeros(len(sampled), k, q.shape[-1])
        spec.draft_probs[hot_index[rows].to(self.device)[sel_d], slots_d[sel_d]] = q

    def _trim(self, spec: SpecBatch, rows: torch.Tensor, slots: torch.Tensor, logits: torch.Tensor, k: int) -> None:
        """Cut the planned rows' verify lengths by their proposals' drafter probabilities
        (planner.confidence): logits [n, V] of proposal slots (rows, slots). Forced rows (first
        reads, probes) keep theirs: their verify is the posterior's evidence. The drafting is
        paid by now, so the step is priced with it sunk, as the head's plan is (_verify_lengths),
        except what the verify pays for leaving its single-token path (OnlineCostModel.trim_cost).
        The probabilities are of the drafter's distributions, never of a draw from them, so the
        cut is lossless at any temperature (planner.confidence)."""
        bs, n = len(spec.lengths), len(spec.drafted)
        top = torch.softmax(logits.float(), dim=-1).amax(-1).cpu().numpy()
        conf = np.zeros((bs, k), dtype=np.float32)
        conf[rows.numpy(), slots.numpy()] = top
        keep = np.ones(bs, dtype=bool)
        keep[spec.drafted] = False
        keep[spec.probes] = True
        if self._online_cost is not None and self.cost_model is None:
            sunk = self._online_cost.trim_cost(bs, n)  # what leaving the single-token verify costs is not sunk
        else:  # a given cost model has no such part: everything drafting costs is paid
            cost = self._cost(bs)
            sunk = PlanCost(cost.fixed + cost.draft_fixed + cost.per_draft * n, cost.per_token,
                            per_proposal=cost.per_proposal)
        planned = spec.lengths.numpy()
        lens = trim_lengths(self.confidence.rate(conf), planned, keep, sunk, self.block_size, self._min_len)
        self.stats.trimmed_slots += int(planned.sum() - lens.sum())
        spec.read_proposals = int(rows.numel())
        spec.lengths = torch.from_numpy(lens)
        spec.confidence = conf
