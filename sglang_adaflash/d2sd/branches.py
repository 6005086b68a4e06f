"""The branches of a draft tree: the alternatives at a recovery point and their continuations.

For each (row j, slot r, length l, w more alternatives) the recovery plan chose, a branch is a
token other than the chain's at slot r (the recovery drafter's best, or the first drafter's
next best; at T > 0 drawn without the chain's token) and, from the recovery drafter, its
continuation; each further alternative is one node. A mixin of D2SDEngine (d2sd.engine), whose
state it reads: `block_size`, `drafter`, `device`, `tree_stats`, `_joint_logits_now`, and
SpecEngine's sampling helpers (`_sampling_tensors`, `_sample`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.sampling import filtered_probs
from .tree import Branch


class BranchProposals:
    def _joint_branches(self, seqs, rows, chain_l, pending, hot_set, q) -> dict[int, list[Branch]]:
        """Slot 1's branch from the recovery drafter's logits of this step's joint forward (its
        block there is the chain's own), the other slots' from the first drafter's ranks."""
        at_one = [p for p in pending if p[1] == 1]
        out = self._first_drafter_branches(seqs, rows, chain_l, [p for p in pending if p[1] != 1], hot_set, q)
        if at_one:
            logits = self._joint_logits_now[[j for j, _, _, _ in at_one]]  # [m, L, V] at slots 1..L
            for j, mine in self._branches_from(seqs, rows, chain_l, at_one, hot_set, logits).items():
                out[j] = mine + out.get(j, [])  # build_row orders branches by slot
        return out

    def _branches(self, seqs, rows, chain_l, pending, hot_set) -> dict[int, list[Branch]]:
        """One recovery-drafter forward for every (row j, slot r, length l, w more alternatives):
        its block holds the chain's tokens before slot r and masks from r on; the branch is its
        best token at r other than the chain's (sampled at T > 0 from its distribution without the
        chain's token), then its tokens at r+1 .. r+l-1; each further alternative is one node, its
        next best token at r (at T > 0 drawn without the chain's and the earlier alternatives'
        tokens, which the verifier knows when it tries it)."""
        b = self.block_size
        # built on the host in numpy: a torch op per branch here was 6 dispatches a branch
        ids = np.full((len(pending), b), self.drafter.config.mask_token_id, dtype=np.int64)
        width = max(ln for _, _, ln, _ in pending)
        slots = np.array([r for _, r, _, _ in pending], dtype=np.int64)
        read = np.minimum(slots[:, None] + np.arange(width)[None], b - 1)  # slots r .. r+l-1, then padding
        for m, (j, r, _, _) in enumerate(pending):
            known = [seqs[rows[j]].last_token] + chain_l[j][: r - 1]
            ids[m, : len(known)] = known
        logits = self._branch_logits(seqs, torch.from_numpy(ids).to(self.device), [rows[j] for j, _, _, _ in pending],
                                     torch.from_numpy(read).to(self.device))  # [m, width, V]
        return self._branches_from(seqs, rows, chain_l, pending, hot_set, logits)

    def _branches_from(self, seqs, rows, chain_l, pending, hot_set, logits) -> dict[int, list[Branch]]:
        """The recovery drafter's branches from its logits [m, >= l, V] at slots r, r+1, ... of
        each pending (row j, slot r, length l, w more alternatives)."""
        greedy = [m for m, (j, _, _, _) in enumerate(pending) if j not in hot_set]
        if greedy:  # every greedy branch's tokens in a few batched reads
            at = torch.tensor(greedy, device=self.device)
            ranked = dict(zip(greedy, self._ranked_tokens(
                logits[at, 0].float(), [chain_l[pending[m][0]][pending[m][1] - 1] for m in greedy],
                [pending[m][3] for m in greedy])))
            rest = dict(zip(greedy, logits[at, 1:].float().argmax(-1).tolist()))  # slots r+1 ..
        out: dict[int, list[Branch]] = {}
        for m, (j, r, ln, n_alt) in enumerate(pending):
            if j not in hot_set:
                mine = [Branch(r, [ranked[m][0]] + rest[m][: ln - 1])] + [Branch(r, [t]) for t in ranked[m][1:]]
            else:
                span = logits[m, :ln]  # a sampled row's slots r .. r+l-1
                seq = seqs[rows[j]]
                q = filtered_probs(span, *self._sampling_tensors([seq], span.shape[0]))
                first = q[0].clone()
                first[chain_l[j][r - 1]] = 0.0  # differs from the chain's token
                if float(first.sum()) <= 0:
                    continue
                first = first / first.sum()
                toks = [int(self._sample(first[None], [seq])[0])] + (self._sample(q[1:], [seq] * (ln - 1)).tolist()
                                                                      if ln > 1 else [])
                mine = [Branch(r, toks, [first] + list(q[1:]))]
                mine += self._sampled_alternatives(r, first, toks[0], n_alt, seq)
            self.tree_stats["alternatives"] += len(mine) - 1
            out.setdefault(j, []).extend(mine)
        return out

    @staticmethod
    def _ranked_tokens(scores: torch.Tensor, excluded: list[int], n_alts: list[int]) -> list[list[int]]:
        """scores [G, V] at each greedy branch's slot, excluded[g] the chain's token there -> each
        row's best 1 + n_alts[g] tokens other than excluded[g], best first. One top-k and one
        device read for every row (a read per branch was a host synchronisation per branch on
        a GPU); the chain's token is dropped on the host."""
        k = min(max(n_alts) + 2, scores.shape[-1])
        top = scores.topk(k).indices.tolist()
        return [[t for t in toks if t != ex][: 1 + n] for toks, ex, n in zip(top, excluded, n_alts)]

    def _first_drafter_branches(self, seqs, rows, chain_l, pending, hot_set, q) -> dict[int, list[Branch]]:
        """Branches without the second drafter: for (row j, slot r, _, w more alternatives), the
        first drafter's best tokens at slot r other than the chain's, one node each (at T > 0 the
        first drawn from its distribution q without the chain's token, each further one without
        every token tried before it, as in _sampled_alternatives)."""
        out: dict[int, list[Branch]] = {}
        greedy = [m for m, (j, _, _, _) in enumerate(pending) if j not in hot_set]
        if greedy:  # every greedy row's alternatives in a few batched reads
            at_rows = torch.tensor([pending[m][0] for m in greedy], device=q.device)
            at_slots = torch.tensor([pending[m][1] - 1 for m in greedy], device=q.device)
            ranked = dict(zip(greedy, self._ranked_tokens(
                q[at_rows, at_slots], [chain_l[pending[m][0]][pending[m][1] - 1] for m in greedy],
                [pending[m][3] for m in greedy])))
        for m, (j, r, _, n_alt) in enumerate(pending):
            if j not in hot_set:
                mine = [Branch(r, [t]) for t in ranked[m]]
            else:
                dist = q[j, r - 1].clone()  # a sampled row's slot r distribution (filtered)
                seq = seqs[rows[j]]
                dist[chain_l[j][r - 1]] = 0.0
                if float(dist.sum()) <= 0:
                    continue
                dist = dist / dist.sum()
                tok = int(self._sample(dist[None], [seq])[0])
                mine = [Branch(r, [tok], dist[None].clone())] + self._sampled_alternatives(r, dist, tok, n_alt, seq)
            self.tree_stats["alternatives"] += len(mine) - 1
            out.setdefault(j, []).extend(mine)
        return out

    def _sampled_alternatives(self, r: int, dist: torch.Tensor, tried: int, n: int, seq) -> list[Branch]:
        """Up to n more one-node alternatives for slot r at T > 0. dist is the branch's own first
        token's distribution (the chain's token already removed), tried that token; each further
        one is drawn from dist without every token tried before it, renormalised, and carries that
        distribution, which is what the verifier's rejection step divides by."""
        out, rest = [], dist.clone()
        for _ in range(n):
            rest[tried] = 0.0
            if float(rest.sum()) <= 0:
                break
            rest = rest / rest.sum()
            tried = int(self._sample(rest[None], [seq])[0])
            out.append(Branch(r, [tried], rest[None].clone()))
        return out
