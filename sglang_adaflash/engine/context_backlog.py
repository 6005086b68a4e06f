"""The drafter's context for rows the draft-or-not choice leaves out: queued, caught up when drafted.

A drafted row's committed tokens extend the drafter's context right after the verify. A row
that is not drafted keeps its committed tokens' target features in a ring (one position per
step, every slot) instead, and projects them in one go when it is drafted again or the ring
is full: the per-step work of steady drafting, deferred while drafting does not pay.

A mixin of SpecEngine (engine.engine), which owns the state it reads: `proposer`, `device`,
`choice` (its max_pending sizes the ring), `max_batch_size`, `cost_model`, and `_pending`,
`_ring`, `_backlog_seconds`, set in its constructor.
"""

from __future__ import annotations

import time

import torch

from ..core.clock import synced_time
from ..target.hf_target import TargetBatch, pad_packed
from .step_state import SpecBatch, _Seq


class ContextBacklog:
    def _catch_up_drafted(self, seqs: list[_Seq], drafted: list[int], probes: list[int]) -> float:
        """Bring the drafted rows' drafter context up to date (_catch_up); returns the seconds
        the forced rows' own catch-up took when it is timed apart (else 0)."""
        if probes and self.choice.forced_charge is None and self.cost_model is None:
            # forced rows riding along on planned drafting: their catch-up (up to the whole
            # probe gap of context) is theirs alone, so it is timed apart and charged to probes
            t0 = time.perf_counter()
            self._catch_up(seqs, probes)
            forced_catch_up = time.perf_counter() - t0
            forced = set(probes)
            self._catch_up(seqs, [i for i in drafted if i not in forced])
            return forced_catch_up
        self._catch_up(seqs, drafted)
        return 0.0

    def _catch_up(self, seqs: list[_Seq], rows: list[int], uncommitted: int = 0) -> None:
        """Feed the drafter the context a row collected while it was not drafted.

        A row that is not drafted keeps its committed tokens' target features in a small
        per-slot buffer instead of projecting them into the drafter's context every step; the
        backlog is projected in one go when the row is drafted again (or the buffer is full).
        """
        cold = [i for i in rows if seqs[i].prompt_feats is not None]
        if cold:  # the prompt's context first (positions 0..P-1); pending tokens follow it
            width = max(seqs[i].prompt_feats.shape[0] for i in cold)
            feats = seqs[cold[0]].prompt_feats.new_zeros(len(cold), width, seqs[cold[0]].prompt_feats.shape[-1])
            for j, i in enumerate(cold):
                feats[j, : seqs[i].prompt_feats.shape[0]] = seqs[i].prompt_feats
                seqs[i].prompt_feats = None
            self.proposer.extend_context(feats, torch.zeros(len(cold), dtype=torch.long, device=self.device), cold)
        late = [i for i in rows if seqs[i].pending]
        if not late or self._pending is None:
            return
        # A row drafted again after steps off projects its backlog here: drafting's deferred
        # per-step work, which steady drafting pays a step at a time. Fitted as a drafted step's
        # price (the drafting fit), it priced on-and-off drafting above steady drafting, and at
        # in-domain c=4 the rule, once off, stayed mostly off: 1.04x `ar` against 1.10x. So its
        # time is counted apart. A prompt's context (above) stays in the fit: a request's first
        # draft pays it whether it then drafts steadily or not.
        t0 = synced_time(self.device)
        width = max(seqs[i].pending for i in late)
        index = torch.tensor(late, dtype=torch.long, device=self.device)
        # the backlog ends at the newest queued token: cache_len, or beyond it by `uncommitted`
        # tokens queued in a step whose commit has not moved cache_len yet
        starts = torch.tensor([seqs[i].cache_len + uncommitted - seqs[i].pending for i in late], device=self.device)
        self.proposer.extend_context(self._pending[self._backlog_positions(seqs, late, width), index[:, None]],
                                     starts, late)
        for i in late:
            seqs[i].pending = 0
        self._backlog_seconds += synced_time(self.device) - t0

    def _update_context(self, seqs, spec: SpecBatch, aux, batch: TargetBatch, committed: list[list[int]]) -> None:
        """Drafted rows extend the drafter's context now; the others queue it (see _catch_up).
        committed: the verify's tokens per row, already on the host."""
        if self.proposer is None or aux is None:
            return
        feats = pad_packed(aux, batch)  # [bs, max L, K*H]
        if spec.drafted:  # a drafting cost: timed with the drafter's
            t0 = time.perf_counter()
            rows = torch.tensor(spec.drafted, dtype=torch.long, device=self.device)
            width = max(len(committed[i]) for i in spec.drafted)
            starts = torch.tensor([seqs[i].cache_len for i in spec.drafted], device=self.device)
            self.proposer.extend_context(feats[rows, :width], starts, spec.drafted)
            spec.draft_seconds += synced_time(self.device) - t0
            drafted = set(spec.drafted)
            idle = [i for i in range(len(seqs)) if i not in drafted]
            if not idle:
                return
            rows = torch.tensor(idle, dtype=torch.long, device=self.device)
        else:  # a plain step (most steps of a batch that does not pay for drafting): every row,
            # whose one committed token's features are feats[:, 0] as they stand (no gather)
            self._queue_idle(seqs, range(len(seqs)), None, feats[:, 0])
            return
        self._queue_idle(seqs, idle, rows, feats[rows, 0])

    def _queue_idle(self, seqs: list[_Seq], idle, rows: torch.Tensor | None, feats: torch.Tensor) -> None:
        """Queue the undrafted rows' committed features [len(idle), K*H] (an undrafted row
        commits exactly one token) for their next catch-up; rows is idle as a device tensor, or
        None when idle is every row (a plain step).

        The queue is a ring with one position per step that queues anyone, holding every slot:
        a row queues on every step it is not drafted and is caught up when it is, so its backlog
        is always the newest `pending` positions (_backlog_positions). A plain step's queueing
        is then one slice copy, where a per-row column took an index tensor and a scatter (the
        queueing took 34-38 us of adaflash's 170 us of extra host work a plain step at math c=8
        on the second machine, benchmarks/adaptive/README.md)."""
        if self._pending is None:
            self._pending = feats.new_zeros(self.choice.max_pending, self.max_batch_size, feats.shape[-1])
        self._ring = (self._ring + 1) % self._pending.shape[0]
        if rows is None:
            self._pending[self._ring, : feats.shape[0]] = feats
        else:
            self._pending[self._ring].index_copy_(0, rows, feats)
        most = 0
        for i in idle:
            seq = seqs[i]
            seq.pending += 1
            most = max(most, seq.pending)
        if most >= self._pending.shape[0]:
            # this runs before the step commits, so each row's newest queued token is one past cache_len
            self._catch_up(seqs, [i for i in idle if seqs[i].pending >= self._pending.shape[0]], uncommitted=1)

    def _backlog_positions(self, seqs: list[_Seq], rows: list[int], width: int) -> torch.Tensor:
        """[len(rows), width] ring positions of the rows' backlogs, oldest first (columns past a
        row's own backlog hold other steps' features, which its context never reads)."""
        first = torch.tensor([self._ring + 1 - seqs[i].pending for i in rows], dtype=torch.long)
        return ((first[:, None] + torch.arange(width)[None]) % self._pending.shape[0]).to(self.device)
