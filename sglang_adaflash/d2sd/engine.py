"""Mode `d2sd`: the reference engine's decode step with a draft tree instead of a chain.

Each step: the first drafter proposes the chain (one forward, as in `dflash`); its confidences
pick the recovery points and the load-aware rule prices the branches (recovery.py); the
recovery drafter continues every chosen branch in one batched forward; the target verifies all
trees in one forward with the ancestor mask (tree_target.py); each request commits its longest
accepted path (tree_verify.py), and only that path's K/V and target features are kept.
Admission, prefill, retirement and the request API are SpecEngine's.
"""

from __future__ import annotations

import time

import torch

from ..drafter.model import DFlashDrafter
from ..engine.engine import SpecEngine, _Seq
from ..engine.sampling import filtered_probs
from ..target.hf_target import HFTarget
from . import TREE_RULES
from .recovery import TreeCost, plan_branches
from .recovery_drafter import TreeProposer
from .tree import Branch, TreeRow, build_row, flatten
from .tree_target import commit_paths, gather_nodes, tree_forward
from .tree_verify import PathResult, greedy_walk, sampling_walk


class D2SDEngine(SpecEngine):
    def __init__(
        self,
        target: HFTarget,
        drafter: DFlashDrafter,
        recovery: DFlashDrafter,
        *,
        tree_k: int = 2,
        branch_len: int = 4,
        tree_rule: str = "load_aware",
        beta: float = 0.5,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        **kw,
    ):
        """`tree_k` and `branch_len` bound the tree (branches per request, tokens per branch);
        under the load-aware rule the step's cost decides how much of it to use, `fixed` always
        takes all of it. `beta` is the prior per-slot survival of a branch's continuation."""
        if drafter is None or recovery is None:
            raise ValueError("mode 'd2sd' needs a drafter and a recovery drafter (--recovery-drafter DIR)")
        if tree_k < 0 or branch_len < 1:
            raise ValueError(f"d2sd needs tree_k >= 0 and branch_len >= 1, got {tree_k} and {branch_len}")
        if tree_rule not in TREE_RULES:
            raise ValueError(f"tree_rule must be one of {TREE_RULES}, got {tree_rule!r}")
        for d in (drafter, recovery):
            d.share_target_modules(target.embed_tokens, target.lm_head)
        capacity = max_seq_len + drafter.config.block_size + 1
        proposer = TreeProposer(drafter, recovery, num_slots=max_batch_size, capacity=capacity)
        proposer.target_layer_ids = list(drafter.config.target_layer_ids)
        kw.pop("mode", None)
        super().__init__(target, drafter, mode="dflash", proposer=proposer, max_batch_size=max_batch_size,
                         max_seq_len=max_seq_len, **kw)
        self.mode = "d2sd"
        self.recovery = recovery
        self.tree_k, self.branch_len, self.tree_rule = tree_k, branch_len, tree_rule
        self.beta = beta
        self._beta_obs = [0.0, 0.0]  # continuation slots accepted, tried (decayed)
        self._tree_cost: tuple[float, float] | None = None  # recovery drafter (per_branch, fixed)
        self.tree_stats = {"branches": 0, "branch_tokens": 0, "branch_wins": 0, "steps": 0}

    # -- the two drafting calls (tests override them with oracles) -------------------------
    def _chain_logits(self, seqs: list[_Seq], rows: list[int]) -> torch.Tensor:
        """[n, B-1, V] logits of block slots 1..B-1 for the given rows."""
        last = torch.tensor([seqs[i].last_token for i in rows], device=self.device)
        ctx = torch.tensor([seqs[i].cache_len for i in rows], device=self.device)
        hidden = self.proposer.propose(last, ctx, None, slots=rows)
        return self.drafter.logits(hidden[:, 1:])

    def _branch_logits(self, seqs: list[_Seq], block_ids: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """[m, B, V] recovery-drafter logits for blocks block_ids [m, B] of the given rows."""
        ctx = torch.tensor([seqs[i].cache_len for i in rows], device=self.device)
        slots = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.recovery.logits(self.proposer.propose_branches(block_ids, ctx, slots))

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _decode_step(self) -> None:
        seqs, t0 = self.running, time.perf_counter()
        bs, b = len(seqs), self.block_size
        cap = [min(b, s.remaining) for s in seqs]
        drafted = [i for i in range(bs) if cap[i] > 1]
        trees = [build_row(s.last_token, [], []) for s in seqs]
        if drafted:
            self._draft_trees(seqs, drafted, cap, trees)
        t1 = time.perf_counter()
        flat = flatten(trees, self.device)
        starts = torch.tensor([s.cache_len for s in seqs], device=self.device)
        fwd = tree_forward(self.target, self.cache, flat, starts)
        results = self._walk(seqs, trees, fwd.logits)
        width = max(len(r.path) for r in results)
        paths = torch.zeros(bs, width, dtype=torch.long)
        for i, r in enumerate(results):
            paths[i, : len(r.path)] = torch.tensor(r.path)
        paths = paths.to(self.device)
        commit_paths(self.cache, fwd.node_kv, paths, starts)
        if fwd.aux is not None:
            self.proposer.extend_context(gather_nodes(fwd.aux, paths), starts, list(range(bs)))
        self._observe_branches(trees, results, cap)
        for seq, tree, r in zip(seqs, trees, results):
            seq.stats.record(tree.size, r.num_accepted)
            seq.cache_len += len(r.tokens)
            self.stats.committed_tokens += len(r.tokens)
            self._append(seq, r.tokens)
        t2 = time.perf_counter()
        verified = int(flat.sizes.sum())
        self.stats.steps += 1
        self.stats.batch_sizes.append(bs)
        self.stats.verified_tokens += verified
        self.stats.draft_seconds += t1 - t0
        self.stats.verify_seconds += t2 - t1
        self.tree_stats["steps"] += 1
        if self._online_cost is not None:
            self._online_cost.observe(bs, verified, t2 - t1, drafted=len(drafted), draft_seconds=t1 - t0,
                                      proposals=verified - bs)

    def _draft_trees(self, seqs, rows: list[int], cap: list[int], trees: list[TreeRow]) -> None:
        logits = self._chain_logits(seqs, rows)  # [n, B-1, V]
        hot = [j for j, i in enumerate(rows) if not seqs[i].req.sampling.greedy]
        q = logits.float().softmax(-1)
        if hot:
            temp, top_k, top_p = self._sampling_tensors([seqs[rows[j]] for j in hot], logits.shape[1])
            q[hot] = filtered_probs(logits[hot].flatten(0, 1), temp, top_k, top_p).view(len(hot), logits.shape[1], -1)
        chain = q.argmax(-1)  # [n, B-1]
        if hot:
            chain[hot] = self._sample(q[hot].flatten(0, 1)).view(len(hot), -1)
        top2 = q.topk(2, dim=-1).values  # distribution-only inputs to the plan (see tree_verify)
        lengths = torch.tensor([cap[i] for i in rows], device=self.device)
        plan = plan_branches(top2[..., 0], top2[..., 1], lengths, k=self.tree_k, branch_len=self.branch_len,
                             beta=self._beta(), cost=self._tree_cost_model(len(seqs), rows, cap))
        chain_l, slots_l, lens_l = chain.tolist(), plan.slots.tolist(), plan.lengths.tolist()
        hot_set = set(hot)
        branches: dict[int, list[Branch]] = {j: [] for j in range(len(rows))}
        pending = []  # (row j, Branch) needing the recovery drafter
        for j in range(len(rows)):
            for r, ln in zip(slots_l[j], lens_l[j]):
                if ln < 1:
                    continue
                qa = q[j, r - 1].clone()
                qa[chain_l[j][r - 1]] = 0.0  # the alternative differs from the chain's token
                if float(qa.sum()) <= 0:
                    continue
                qa = qa / qa.sum()
                alt = int(self._sample(qa[None])[0]) if j in hot_set else int(qa.argmax())
                br = Branch(r, [alt], [qa] if j in hot_set else None)
                branches[j].append(br)
                if ln > 1:
                    pending.append((j, br, ln))
        if pending:
            self._continue_branches(seqs, rows, chain_l, pending, hot_set)
        for j, i in enumerate(rows):
            chain_q = q[j, : cap[i] - 1] if j in hot_set else None
            trees[i] = build_row(seqs[i].last_token, chain_l[j][: cap[i] - 1], branches[j], chain_q)

    def _continue_branches(self, seqs, rows, chain_l, pending, hot_set) -> None:
        b = self.block_size
        mask_id = self.drafter.config.mask_token_id
        ids = torch.full((len(pending), b), mask_id, dtype=torch.long)
        for m, (j, br, _) in enumerate(pending):
            known = [seqs[rows[j]].last_token] + chain_l[j][: br.slot - 1] + [br.tokens[0]]
            ids[m, : len(known)] = torch.tensor(known)
        logits = self._branch_logits(seqs, ids.to(self.device), [rows[j] for j, _, _ in pending])  # [m, B, V]
        for m, (j, br, ln) in enumerate(pending):
            span = logits[m, br.slot + 1 : br.slot + ln]  # slots r+1 .. r+l-1
            if j in hot_set:
                seq = seqs[rows[j]]
                temp, top_k, top_p = self._sampling_tensors([seq], span.shape[0])
                qb = filtered_probs(span, temp, top_k, top_p)
                br.tokens += self._sample(qb).tolist()
                br.probs = [br.probs[0]] + list(qb)
            else:
                br.tokens += span.argmax(-1).tolist()

    def _walk(self, seqs, trees: list[TreeRow], logits: torch.Tensor) -> list[PathResult]:
        ids = logits.argmax(-1).tolist()
        out = []
        for i, (seq, tree) in enumerate(zip(seqs, trees)):
            if seq.req.sampling.greedy:
                out.append(greedy_walk(tree, ids[i][: tree.size]))
                continue
            temp, top_k, top_p = self._sampling_tensors([seq], tree.size)
            p = filtered_probs(logits[i, : tree.size], temp, top_k, top_p)
            out.append(sampling_walk(tree, p, self.generator))
        return out

    # -- costs and the branch survival -----------------------------------------------------
    def _beta(self) -> float:
        won, tried = self._beta_obs
        return (won + 4 * self.beta) / (tried + 4)  # a prior worth four slots

    def _observe_branches(self, trees: list[TreeRow], results: list[PathResult], cap) -> None:
        """Continuation slots tried and accepted on branches whose alternative was accepted."""
        won = tried = 0.0
        for tree, r in zip(trees, results):
            chain_end = next((k for k in range(1, tree.size) if tree.parents[k] != k - 1), tree.size)
            on_branch = [n for n in r.path if n >= chain_end]
            n_branch = tree.size - chain_end
            self.tree_stats["branches"] += sum(1 for k in range(chain_end, tree.size) if tree.parents[k] < chain_end)
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

    def _tree_cost_model(self, bs: int, rows: list[int], cap: list[int]) -> TreeCost | None:
        if self.tree_rule == "fixed":
            return None
        c = self._cost(bs)
        if self._tree_cost is None:
            self._tree_cost = self._profile_recovery()
        per_branch, branch_fixed = self._tree_cost
        chain_tokens = sum(cap[i] for i in rows) + (bs - len(rows))
        fixed = c.fixed + c.draft_fixed + c.per_draft * len(rows) + c.per_token * chain_tokens
        return TreeCost(fixed=fixed, per_token=c.per_token, per_branch=per_branch, branch_fixed=branch_fixed)

    def _profile_recovery(self, repeats: int = 2) -> tuple[float, float]:
        """Seconds of the recovery drafter's forward: a fixed part and a part per branch."""
        times, wide = [], min(8, self.max_batch_size)
        for m in (1, wide):
            ids = torch.full((m, self.block_size), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
            zero = torch.zeros(m, dtype=torch.long, device=self.device)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                self.proposer.propose_branches(ids, zero + 1, zero)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        per = max((times[1] - times[0]) / max(wide - 1, 1), 0.0)
        return per, max(times[0] - per, 0.0)
