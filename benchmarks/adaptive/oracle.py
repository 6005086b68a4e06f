"""The oracle that knows every draft's fate: the ceiling of adaptive verification on a machine.

At T=0 every run commits `ar`'s tokens, so how many of each request's proposals the target will
accept at every position is a table per prompt (`foresee`), made before any timed run: for each
committed length m, the drafter's leading proposals that equal the target's next tokens. The
`OracleEngine` reads it every step: it drafts only the rows whose next draft will accept at
least a_min proposals, only the block slots it will verify (the proposer's `read`), and verifies
exactly those proposals plus the bonus token of the drafted rows, and the bonus token alone of
every other row. It pays no length head, no planner, no probe and no rejected slot; the trivial
policy of never drafting is `ar` itself. So max(`ar`, the oracles) bounds every verify-length
rule with this drafter, target and engine on this machine.

Used by run.py (the oracle beside ar, dflash and adaflash in one table) and bound.py (the
oracles alone, with more thresholds).
"""

from __future__ import annotations

import time

import torch

from sglang_adaflash.engine.engine import SpecBatch, SpecEngine
from sglang_adaflash.engine.proposer import DFlashProposer
from sglang_adaflash.target.hf_target import TargetBatch


@torch.inference_mode()
def foresee(pair, prompt: list[int], output: list[int], *, block_size: int) -> list[int]:
    """accepted[m]: the drafter's leading proposals that equal output[m:], when it drafts with
    output[:m] committed (m >= 1; block slot 0 holds output[m - 1]). At T=0 the committed prefix
    of every run is `output`, so this is known before any run, from one target forward over the
    whole sequence and one drafter forward with a row per position."""
    target, drafter = pair.target, pair.drafter
    drafter.share_target_modules(target.embed_tokens, target.lm_head)  # as every engine does
    if len(output) < 2:
        return [0] * len(output)
    seq = prompt + output
    saved = target.capture_layer_ids
    target.capture_layer_ids = list(drafter.config.target_layer_ids)
    try:
        _, aux = target.forward(TargetBatch.from_lists([seq], [0]), target.new_cache(1, len(seq) + 1))
    finally:
        target.capture_layer_ids = saved
    proposer = DFlashProposer(drafter, num_slots=1, capacity=len(seq) + block_size + 1)
    proposer.extend_context(aux[None], torch.zeros(1, dtype=torch.long), [0])
    m = torch.arange(1, len(output))  # every decode step's committed output length
    last = torch.tensor(output)[m - 1]
    hidden = proposer.propose(last, len(prompt) + m - 1, slots=[0] * len(m))  # [M, B, H]
    proposals = drafter.logits(hidden[:, 1:]).argmax(-1).tolist()  # [M, B-1]
    accepted = [0]  # m = 0 never drafts (prefill makes the first token)
    for mi, props in zip(m.tolist(), proposals):
        ahead, a = output[mi:], 0
        while a < min(len(props), len(ahead)) and props[a] == ahead[a]:
            a += 1
        accepted.append(a)
    return accepted


class OracleEngine(SpecEngine):
    """SpecEngine whose draft step knows each row's accepted count ahead (greedy rows only).

    accepted: request id -> foresee()'s table for its prompt; a_min: the fewest accepted
    proposals for which a row is drafted at all.
    """

    def __init__(self, *args, accepted: dict[str, list[int]], a_min: int = 1, **kwargs):
        super().__init__(*args, mode="adaflash", **kwargs)
        self.accepted, self.a_min = accepted, a_min
        self.foreseen = 0  # proposals the table said would be accepted, on drafted rows

    def _draft_rows(self, seqs) -> SpecBatch:
        bs = len(seqs)
        lengths = torch.ones(bs, dtype=torch.long)
        for i, s in enumerate(seqs):
            cap = min(self.block_size, s.remaining)
            a = self.accepted[s.req.request_id][len(s.output)]
            if cap > 1 and a >= self.a_min:
                lengths[i] = min(a + 1, cap)
        drafted = lengths.gt(1).nonzero().flatten().tolist()
        if not drafted:
            return SpecBatch.plain(bs, self.device)
        t0 = time.perf_counter()
        self._catch_up(seqs, drafted)  # what drafting after plain steps costs any rule
        k = int(lengths.max()) - 1
        last = torch.tensor([seqs[i].last_token for i in drafted], device=self.device)
        ctx = torch.tensor([seqs[i].cache_len for i in drafted], device=self.device)
        read = torch.arange(1, k + 1, device=self.device)[None].expand(len(drafted), k)
        hidden = self.proposer.propose(last, ctx, slots=drafted, read=read)  # [n, k, H]
        # the LM head only where a row verifies (as SpecEngine._proposals): a row of logits costs
        # more than a slot's query side, and a batch's longest row must not price the others
        needed = torch.arange(k)[None] < (lengths[drafted] - 1)[:, None]  # [n, k]
        j, slot = needed.nonzero(as_tuple=True)
        spec = SpecBatch(lengths, drafted=drafted)
        spec.draft_ids = torch.zeros(bs, k, dtype=torch.long, device=self.device)
        rows = torch.tensor(drafted, dtype=torch.long)[j]
        spec.draft_ids[rows.to(self.device), slot.to(self.device)] = self.drafter.logits(hidden[j, slot]).argmax(-1)
        spec.draft_seconds = time.perf_counter() - t0
        self.foreseen += int(lengths[drafted].sum()) - len(drafted)
        return spec
