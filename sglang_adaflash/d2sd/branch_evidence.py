"""What D2SD learns from its verified trees: branch survival, the alternatives' hit rates, and
the calibration of the chain's confidence; and what a branch costs.

A mixin of D2SDEngine (d2sd.engine), whose state it reads and updates: `beta`, `alt_prior`,
`branch_width`, `branch_drafter`, `tree_rule`, `tree_stats`, `_source`, `_beta_obs`,
`_alt_obs`, `_first_obs`, `_joint_obs`, `_calib`, `_raw_conf`, `_tree_cost`, and SpecEngine's
`_cost`, `proposer`, `recovery`, `drafter`, `block_size`, `max_batch_size`, `device`.
"""

from __future__ import annotations

import torch

from ..core.clock import synced_time
from .recovery import TreeCost
from .tree import TreeRow
from .tree_verify import PathResult


class BranchEvidence:
    # -- costs and the branch survival -----------------------------------------------------
    def _beta(self) -> float:
        won, tried = self._beta_obs
        return (won + 4 * self.beta) / (tried + 4)  # a prior worth four slots

    def _alt_rate(self, rank: int = 0, obs=None) -> float:
        """How often the alternative of this rank at a branch's slot is right when the chain's
        token is wrong there (measured; the prior halves with each rank). obs: whose record
        (the branches' source's; the recovery drafter's by default)."""
        won, tried = (self._alt_obs if obs is None else obs)[rank]
        return (won + 4 * self.alt_prior / 2 ** rank) / (tried + 4)

    def _observe_branches(self, trees: list[TreeRow], results: list[PathResult], cap) -> None:
        """Continuation slots tried and accepted on branches whose alternative was accepted."""
        won = tried = 0.0
        alt_won, alt_tried = [0.0] * self.branch_width, [0.0] * self.branch_width
        joint = self._source == "joint"
        one_won, one_tried = [0.0] * self.branch_width, [0.0] * self.branch_width  # slot 1's, under joint
        for tree, r in zip(trees, results):
            chain_end = tree.chain_length
            on_branch = [n for n in r.path if n >= chain_end]
            n_branch = tree.size - chain_end
            firsts = [k for k in range(chain_end, tree.size) if tree.parents[k] < chain_end]
            self.tree_stats["branches"] += len(firsts)
            path = set(r.path)
            rank: dict[int, int] = {}  # alternatives under one chain node, in the order tried
            for k in firsts:  # tested: its parent was reached and the chain's token there rejected
                parent = tree.parents[k]
                w = rank[parent] = rank.get(parent, -1) + 1
                if parent in path and parent + 1 not in path and w < self.branch_width:
                    into_won, into_tried = (one_won, one_tried) if joint and parent == 0 else (alt_won, alt_tried)
                    into_tried[w] += 1
                    into_won[w] += k in path
            self.tree_stats["branch_tokens"] += n_branch
            if on_branch:
                self.tree_stats["branch_wins"] += 1
                first = on_branch[0]
                kids = tree.children()
                length, node = 0, first
                while kids[node]:
                    node = kids[node][0]
                    length += 1
                tried += length
                won += len(on_branch) - 1
        self._beta_obs = [0.98 * self._beta_obs[0] + won, 0.98 * self._beta_obs[1] + tried]
        # under auto the step's branches came from one source: its record moves, the other's stands
        # under joint, slot 1's alternatives are the recovery drafter's and the others the first's
        mine = self._first_obs if joint or (self.branch_drafter == "auto" and self._source == "first") else self._alt_obs
        mine[:] = [[0.98 * o[0] + a, 0.98 * o[1] + t] for o, a, t in zip(mine, alt_won, alt_tried)]
        if joint:
            self._joint_obs[:] = [[0.98 * o[0] + a, 0.98 * o[1] + t]
                                  for o, a, t in zip(self._joint_obs, one_won, one_tried)]

    def _tree_cost_model(self, bs: int, rows: list[int]) -> TreeCost | None:
        if self.tree_rule == "fixed":
            return None
        c = self._cost(bs)
        if self._tree_cost is None:  # a first-drafter branch costs its verify token only; a joint one was drafted already
            self._tree_cost = (0.0, 0.0) if self.branch_drafter in ("first", "joint") else self._profile_recovery()
        per_branch, branch_fixed = self._tree_cost
        # the chain's drafting is paid already; undrafted rows verify their bonus token
        fixed = c.fixed + c.draft_fixed + c.per_draft * len(rows) + c.per_token * (bs - len(rows))
        return TreeCost(fixed=fixed, per_token=c.per_token, per_branch=per_branch, branch_fixed=branch_fixed)

    # -- calibration of the chain's confidence ---------------------------------------------
    _BINS = 10

    def _calibrated(self, conf: torch.Tensor) -> torch.Tensor:
        """The chain's survival per slot, read from its confidence through the acceptance
        actually seen at that confidence (binned, shrunk to the raw value with 4 slots' weight)."""
        if self.tree_rule == "fixed":
            return conf
        tested, won = self._calib
        b = (conf * self._BINS).long().clamp(max=self._BINS - 1)
        return (won.to(conf.device)[b] + 4 * conf) / (tested.to(conf.device)[b] + 4)

    def _observe_chain(self, results: list[PathResult]) -> None:
        """Chain slots verified (reached with every earlier chain slot accepted) and accepted."""
        tested, won = self._calib
        tested.mul_(0.995)
        won.mul_(0.995)
        parts, accepted = [], []  # each row's tested slots' confidences; whether each was accepted
        for i, r in enumerate(results):
            raw = self._raw_conf.get(i)
            if raw is None or raw.numel() == 0:
                continue
            on_chain = next((k for k, n in enumerate(r.path) if n != k), len(r.path)) - 1  # accepted chain slots
            upto = min(on_chain + 1, raw.numel())
            parts.append(raw[:upto])
            accepted += [k < on_chain for k in range(upto)]
        if not parts:
            return
        # one device read for the batch (a read per row was a host sync per row on a GPU)
        b = (torch.cat(parts).float().cpu() * self._BINS).long().clamp(max=self._BINS - 1)
        tested.index_add_(0, b, torch.ones(len(b)))
        hit = b[torch.tensor(accepted, dtype=torch.bool)]
        won.index_add_(0, hit, torch.ones(len(hit)))

    def _profile_recovery(self, repeats: int = 2) -> tuple[float, float]:
        """Seconds of the recovery drafter's forward and LM head: a fixed part and a part per branch."""
        times, wide = [], min(8, self.max_batch_size)
        for m in (1, wide):
            ids = torch.full((m, self.block_size), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
            zero = torch.zeros(m, dtype=torch.long, device=self.device)
            read = torch.arange(1, 1 + self.branch_len, device=self.device).clamp(max=self.block_size - 1)
            read = read[None].expand(m, -1)
            best = float("inf")
            for _ in range(repeats):
                t0 = synced_time(self.device)
                self.recovery.logits(self.proposer.propose_branches(ids, zero + 1, zero, read))
                best = min(best, synced_time(self.device) - t0)
            times.append(best)
        per = max((times[1] - times[0]) / max(wide - 1, 1), 0.0)
        return per, max(times[0] - per, 0.0)
