"""Mode `d2sd`: the reference engine's decode step with a draft tree instead of a chain.

Each step: the first drafter proposes the chain (one forward, as in `dflash`); its confidences
pick the recovery points and the load-aware rule prices the branches (recovery.py); the
recovery drafter continues every chosen branch in one batched forward; the target verifies all
trees in one forward with the ancestor mask (tree_target.py); each request commits its longest
accepted path (tree_verify.py), and only that path's K/V and target features are kept.
Admission, prefill, retirement and the request API are SpecEngine's.

With draft-off (`draft_off=True`, the load-aware rule only) the step first asks SpecEngine's
draft-or-not choice (engine/draft_choice.py) whom to draft at all, from each request's measured
tree acceptance: a step that drafts nobody is SpecEngine's plain verify of the bonus tokens, and
the rows left out of a tree step queue their context for a later catch-up, as in `adaflash`.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from ..core.clock import synced_time
from ..core.sampling import filtered_probs
from ..drafter.model import DFlashDrafter
from ..engine.engine import SpecEngine
from ..engine.step_state import SpecBatch, _Seq
from ..planner.calibration import SurvivalPosterior
from ..target.hf_target import HFTarget
from . import BRANCH_DRAFTERS, TREE_RULES, cascade, joint
from .recovery import TreeCost, plan_tree
from .recovery_drafter import TreeProposer, source_limitation
from .tree import Branch, TreeRow, build_row, flatten
from .tree_target import TreeForward, commit_paths, gather_nodes, tree_forward
from .tree_verify import PathResult, greedy_reads, greedy_walk, sampling_walk


class D2SDEngine(SpecEngine):
    def __init__(
        self,
        target: HFTarget,
        drafter: DFlashDrafter,
        recovery: DFlashDrafter,
        *,
        tree_k: int = 2,
        branch_len: int = 4,
        branch_width: int = 1,
        tree_rule: str = "load_aware",
        tree_attention: str = "auto",
        branch_drafter: str = "recovery",
        beta: float = 0.5,
        alt_prior: float = 0.3,
        draft_off: bool = False,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        **kw,
    ):
        """`tree_k` and `branch_len` bound the tree (branches per request, tokens per branch),
        `branch_width` the alternatives for a branch's slot (1: the branch's own; more add the
        recovery drafter's next-ranked tokens there, one node each);
        under the load-aware rule the step's cost decides how much of it to use, `fixed` always
        takes all of it. `beta` is the prior per-slot survival of a branch's continuation and
        `alt_prior` the prior chance that a branch's first token is right where the chain fails;
        both are then measured as the engine serves. `tree_attention` picks how the target attends
        over the trees (cascade.py: auto = FlashInfer's cascade attention where it fits).

        `branch_drafter` "first" builds the tree without the second drafter: each branch is one
        node, the first drafter's next-ranked token at the slot (its later slots follow its own
        likeliest continuation, not an alternative, so they cannot continue one), and
        `branch_len` is 1 whatever was asked. It costs verify tokens only, no drafter forward: the baseline that
        does a tree's job with one drafter, and `recovery` may then be None. "auto" prices both
        each step (recovery.plan_tree's first_rates) and builds the better tree: the recovery
        drafter's branches where they pay for its forward, the first drafter's next-ranked tokens
        (or no branch) where they do not; each source's rates are measured on its own steps. It
        needs the load-aware rule (the fixed rule does not price).

        `draft_off` lets the load-aware rule leave out requests whose trees do not pay for
        their drafting and verify slots, as `adaflash` does with chains (SpecEngine's
        probe_every, probe_share and explore apply): each request's survival is what its trees
        really committed (the accepted path's depth against the tree's), so a request is drafted
        when its measured gain pays for a drafted row at the measured step cost."""
        if branch_drafter not in BRANCH_DRAFTERS:
            raise ValueError(f"branch_drafter must be one of {BRANCH_DRAFTERS}, got {branch_drafter!r}")
        if drafter is None or (recovery is None and branch_drafter != "first"):
            raise ValueError("mode 'd2sd' needs a drafter and a recovery drafter (--recovery-drafter DIR)")
        if tree_k < 0 or branch_len < 1 or branch_width < 1:
            raise ValueError(f"d2sd needs tree_k >= 0, branch_len >= 1 and branch_width >= 1, got {tree_k}, "
                             f"{branch_len} and {branch_width}")
        if tree_rule not in TREE_RULES:
            raise ValueError(f"tree_rule must be one of {TREE_RULES}, got {tree_rule!r}")
        if branch_drafter == "auto" and tree_rule != "load_aware":
            raise ValueError("branch_drafter 'auto' needs tree_rule 'load_aware': the fixed rule does not price "
                             "the two sources against each other")
        if draft_off and tree_rule != "load_aware":
            raise ValueError("draft_off needs tree_rule 'load_aware': the fixed rule does not price drafting")
        if branch_drafter == "first":
            recovery = None  # neither run nor given a context
        if branch_drafter == "joint" and (why := joint.incompatibility(drafter, recovery)) is not None:
            raise ValueError(f"branch_drafter 'joint' runs both drafters as one stacked forward, but {why}")
        if (why := source_limitation(branch_drafter, recovery)) is not None:
            raise ValueError(f"this recovery drafter cannot serve branch_drafter {branch_drafter!r}: {why}")
        for d in (drafter, recovery):
            if d is not None:
                d.share_target_modules(target.embed_tokens, target.lm_head)
        capacity = max_seq_len + drafter.config.block_size + 1
        proposer = TreeProposer(drafter, recovery, num_slots=max_batch_size, capacity=capacity,
                                joint=branch_drafter == "joint")
        proposer.target_layer_ids = list(drafter.config.target_layer_ids)
        kw.pop("mode", None)
        super().__init__(target, drafter, mode="dflash", proposer=proposer, max_batch_size=max_batch_size,
                         max_seq_len=max_seq_len, **kw)
        self.mode = "d2sd"
        if draft_off:  # SpecEngine built its choice for mode dflash, which never leaves a row out
            self.posterior = SurvivalPosterior(max_batch_size, device=self.device)  # the choice's, too
            self._draft_off = True
        self.tree_attention = cascade.select(tree_attention, self.device, target.dtype, target.head_dim)
        self._cascade = cascade.make(self.tree_attention, self.device)
        self.recovery = recovery
        self.branch_drafter = branch_drafter
        self.tree_k, self.tree_rule = tree_k, tree_rule
        self.branch_len = 1 if branch_drafter == "first" else branch_len
        self.branch_width = branch_width
        self.trim_chain = True  # under load_aware, the chain's length is planned too
        self.beta = beta
        self._beta_obs = [0.0, 0.0]  # continuation slots accepted, tried (decayed)
        # per alternative rank at a branch's slot: accepted, tried after a chain rejection (decayed)
        self._alt_obs = [[0.0, 0.0] for _ in range(branch_width)]
        # the same for the first drafter's next-ranked tokens, when "auto" or "joint" use them
        self._first_obs = [[0.0, 0.0] for _ in range(branch_width)]
        # and for the recovery drafter's at slot 1 under "joint" (its block there has no known
        # chain token, unlike the sequential recovery forward's deeper ones: measured apart)
        self._joint_obs = [[0.0, 0.0] for _ in range(branch_width)]
        self._joint_logits_now: torch.Tensor | None = None  # this step's recovery logits at slots 1..L
        self._source = branch_drafter if branch_drafter in ("first", "joint") else "recovery"  # the last step's
        self.alt_prior = alt_prior
        self._calib = (torch.zeros(self._BINS), torch.zeros(self._BINS))  # chain slots tested, accepted
        self._raw_conf: dict[int, torch.Tensor] = {}
        self._chain_reach: deque[int] = deque(maxlen=self.CHAIN_REACH_STEPS)  # longest planned chain per step
        self._tree_cost: tuple[float, float] | None = None  # recovery drafter (per_branch, fixed)
        self._last_value = {"recovery": 0.0, "first": 0.0, "joint": 0.0}  # each source's last plan value: its next first price
        self.tree_stats = {"branches": 0, "branch_tokens": 0, "branch_wins": 0, "alternatives": 0, "steps": 0,
                           "planned_steps": 0, "first_drafter_steps": 0, "plain_steps": 0,
                           "idle_rows": 0, "chain_tail_reads": 0}

    # -- the two drafting calls (tests override them with oracles) -------------------------
    def _chain_logits(self, seqs: list[_Seq], rows: list[int], upto: int | None = None) -> torch.Tensor:
        """[n, U, V] logits of block slots 1..U for the given rows: U = upto (at least; None: B-1).
        The pass's states are kept for `_chain_tail`."""
        last = torch.tensor([seqs[i].last_token for i in rows], device=self.device)
        ctx = torch.tensor([seqs[i].cache_len for i in rows], device=self.device)
        self._chain_states = self.proposer.propose(last, ctx, None, slots=rows)[:, 1:]
        return self.drafter.logits(self._chain_states[:, :upto])

    def _joint_logits(self, seqs: list[_Seq], rows: list[int], upto: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both drafters in one stacked forward (joint.py): the chain's logits [n, U, V] (as
        `_chain_logits`) and the recovery drafter's at block slots 1..L [n, L, V] (L = the
        longest slot-1 branch), from one LM-head call."""
        last = torch.tensor([seqs[i].last_token for i in rows], device=self.device)
        ctx = torch.tensor([seqs[i].cache_len for i in rows], device=self.device)
        span = min(self.branch_len, self.block_size - 1)
        first, rec = self.proposer.propose_joint(last, ctx, rows, recovery_rows=slice(1, 1 + span))
        self._chain_states = first[:, 1:]
        u = self.block_size - 1 if upto is None else upto
        logits = self.drafter.logits(torch.cat([first[:, 1 : 1 + u], rec], 1))
        return logits[:, :u], logits[:, u:]

    def _chain_tail(self, seqs: list[_Seq], rows: list[int], start: int) -> torch.Tensor:
        """[n, B-1-start, V] logits of block slots start+1..B-1 of this step's drafting pass."""
        return self.drafter.logits(self._chain_states[:, start:])

    def _branch_logits(self, seqs: list[_Seq], block_ids: torch.Tensor, rows: list[int],
                       read: torch.Tensor) -> torch.Tensor:
        """[m, R, V] recovery-drafter logits at block slots read [m, R] of blocks block_ids [m, B]
        of the given rows (only the slots a branch uses: its state and LM head rows cost)."""
        ctx = torch.tensor([seqs[i].cache_len for i in rows], device=self.device)
        slots = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.recovery.logits(self.proposer.propose_branches(block_ids, ctx, slots, read))

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _decode_step(self) -> None:
        seqs, t0 = self.running, time.perf_counter()
        bs = len(seqs)
        cap = self._draft_caps(seqs)
        drafted, probes = self._choose_drafted(seqs, cap)
        if self._draft_off and not drafted:  # nobody pays for a tree: SpecEngine's plain step
            self._verify_step(seqs, self._with_sampling(SpecBatch.plain(bs, self.device), seqs), t0,
                              synced_time(self.device))
            for seq in seqs:
                seq.stats.drafted.append(False)
            self.tree_stats["plain_steps"] += 1
            self.tree_stats["idle_rows"] += bs
            return
        backlog = self._backlog_seconds
        forced_catch_up = self._catch_up_drafted(seqs, drafted, probes) if self._draft_off else 0.0
        backlog = self._backlog_seconds - backlog  # steady drafting's deferred work: not in the drafting fit
        trees = [build_row(s.last_token, [], []) for s in seqs]
        self._raw_conf = {}
        if drafted:
            self._draft_trees(seqs, drafted, cap, trees)
        t1 = synced_time(self.device)
        flat = flatten(trees, self.device)
        starts = torch.tensor([s.cache_len for s in seqs], device=self.device)
        fwd = tree_forward(self.target, self.cache, flat, starts, self._cascade)
        results = self._walk(seqs, trees, fwd)
        width = max(len(r.path) for r in results)
        # on the host, each path padded with the identity (commit_paths moves no chain node)
        paths = torch.tensor([r.path + list(range(len(r.path), width)) for r in results], dtype=torch.long)
        commit_paths(self.cache, fwd, paths, starts)
        if fwd.aux is not None:
            self._extend_contexts(seqs, drafted, gather_nodes(fwd.aux, paths.to(self.device)), starts)
        self._observe_branches(trees, results, cap)
        self._observe_chain(results)
        if self._draft_off:
            self._observe_survival(drafted, trees, results)
        mine = set(drafted)
        self.tree_stats["idle_rows"] += (bs - len(mine)) if self._draft_off else 0
        for i, (seq, tree, r) in enumerate(zip(seqs, trees, results)):
            seq.stats.record(tree.size, r.num_accepted)
            if self._draft_off:
                seq.stats.drafted.append(i in mine)
            self._commit_row(seq, r.tokens, drafted=(i in mine) if self._draft_off else None, probed=i in probes)
        t2 = synced_time(self.device)
        verified = int(flat.sizes.sum())
        if self._draft_off:
            spec = SpecBatch(torch.ones(bs, dtype=torch.long), drafted=drafted, probes=probes,
                             draft_seconds=t1 - t0, forced_catch_up_seconds=forced_catch_up)
            self.choice.charge_forced(spec, verified - bs, verify_seconds=t2 - t1)
        self.stats.steps += 1
        self.stats.batch_sizes.append(bs)
        self.stats.verified_tokens += verified
        self.stats.draft_seconds += t1 - t0
        self.stats.verify_seconds += t2 - t1
        self.tree_stats["steps"] += 1
        if self._online_cost is not None:
            self._online_cost.observe(bs, verified, t2 - t1, drafted=len(drafted), draft_seconds=t1 - t0 - backlog,
                                      proposals=verified - bs)

    def _extend_contexts(self, seqs, drafted: list[int], feats: torch.Tensor, starts: torch.Tensor) -> None:
        """Committed paths' target features [bs, W, K*H] into the drafters' contexts. Under
        draft-off only the drafted rows' go in now; the others committed their bonus token alone
        and queue its features for their next catch-up (SpecEngine._queue_idle)."""
        bs = len(seqs)
        if not self._draft_off or len(drafted) == bs:
            self.proposer.extend_context(feats, starts, list(range(bs)))
            return
        if drafted:
            rows = torch.tensor(drafted, dtype=torch.long, device=self.device)
            self.proposer.extend_context(feats[rows], starts[rows], drafted)
        mine = set(drafted)
        idle = [i for i in range(bs) if i not in mine]
        rows = torch.tensor(idle, dtype=torch.long, device=self.device)
        self._queue_idle(seqs, idle, rows, feats[rows, 0])

    def _observe_survival(self, drafted: list[int], trees: list[TreeRow], results: list[PathResult]) -> None:
        """Each drafted request's posterior: the committed path's accepted proposals are
        survivals, and a failure is counted only when the walk stopped at a node that had
        children (a proposal after it was rejected); a path that ran to a leaf, of the chain or
        of a branch deeper than the trimmed chain, rejected nothing. The drafter's own opinion is
        the chain's mean calibrated confidence."""
        if not drafted:
            return
        accepted, offered = [], []
        for i in drafted:
            kids, n = trees[i].children(), results[i].num_accepted
            accepted.append(n)
            offered.append(n + 1 + bool(kids[results[i].path[-1]]))  # verify length: n proposals (+ the rejected)
        prior = torch.tensor(self.beta, device=self.device)
        raw = [self._raw_conf.get(i) for i in drafted]
        opinion = torch.stack([self._calibrated(c).float().mean() if c is not None and c.numel() else prior
                               for c in raw])
        slots = torch.tensor(drafted, dtype=torch.long, device=self.device)
        self.posterior.observe(slots, opinion, torch.tensor(accepted, device=self.device),
                               torch.tensor(offered, device=self.device))

    def _draft_trees(self, seqs, rows: list[int], cap: list[int], trees: list[TreeRow]) -> None:
        # a planned chain rarely reaches far into the block: the LM head reads the first slots,
        # and the rest only when some chain was planned to the end of those (see CHAIN_HEAD_SLOTS)
        head = self.CHAIN_HEAD_SLOTS
        if self.tree_rule != "load_aware" or not self.trim_chain or head is None or head >= self.block_size - 1:
            head = None  # the whole block: the fixed rule verifies whole chains
        elif self._chain_reach:  # one slot past the longest chain planned in recent steps
            head = min(head, max(self._chain_reach) + 1)
        if self.branch_drafter == "joint":
            logits, self._joint_logits_now = self._joint_logits(seqs, rows, upto=head)
        else:
            logits = self._chain_logits(seqs, rows, upto=head)
        hot = [j for j, i in enumerate(rows) if not seqs[i].req.sampling.greedy]
        q, top1, chain = self._read_chain(seqs, rows, hot, logits)
        caps = torch.tensor([cap[i] for i in rows])  # host: the plan is solved there (plan_tree)
        plan = self._plan(seqs, rows, top1, caps)
        read = top1.shape[1]
        if read < self.block_size - 1 and bool(((plan.chain.cpu() - 1 >= read) & (caps - 1 > read)).any()):
            tail = self._read_chain(seqs, rows, hot, self._chain_tail(seqs, rows, read))
            q, top1, chain = (torch.cat([a, b], 1) for a, b in zip((q, top1, chain), tail))
            self.tree_stats["chain_tail_reads"] += 1
            plan = self._plan(seqs, rows, top1, caps)
        if head is not None:
            self._chain_reach.append(int(plan.chain.max()) - 1)
        if self.branch_drafter not in ("first", "joint"):
            self._source = plan.source
        if plan.value == plan.value:  # nan under the fixed rule
            self._last_value[self._source] = plan.value
        self.tree_stats["planned_steps"] += 1  # steps that drafted anyone (the others verify bonus tokens only)
        self.tree_stats["first_drafter_steps"] += self._source == "first"
        # the plan is on the host already: the chain's ids are this block's one read
        chain_l, slots_l, lens_l = chain.tolist(), plan.slots.tolist(), plan.lengths.tolist()
        extra_l, chain_len = plan.extra.tolist(), plan.chain.tolist()
        self._raw_conf = {i: top1[j, : chain_len[j] - 1] for j, i in enumerate(rows)}
        hot_set = set(hot)
        pending = [(j, r, ln, w) for j in range(len(rows)) for r, ln, w in zip(slots_l[j], lens_l[j], extra_l[j]) if ln >= 1]
        if not pending:
            branches = {}
        elif self._source == "first":
            branches = self._first_drafter_branches(seqs, rows, chain_l, pending, hot_set, q)
        elif self._source == "joint":
            branches = self._joint_branches(seqs, rows, chain_l, pending, hot_set, q)
        else:
            branches = self._branches(seqs, rows, chain_l, pending, hot_set)
        for j, i in enumerate(rows):
            n_chain = chain_len[j] - 1
            chain_q = q[j, :n_chain] if j in hot_set else None
            trees[i] = build_row(seqs[i].last_token, chain_l[j][:n_chain], branches.get(j, []), chain_q)

    def _read_chain(self, seqs, rows: list[int], hot: list[int], logits: torch.Tensor):
        """The drafter's distribution q [n, S, V] over slots of `logits` [n, S, V], its top
        probability and the chain's tokens (greedy rows: the top token; sampled rows: a draw)."""
        q = logits.float().softmax(-1)
        if hot:
            temp, top_k, top_p = self._sampling_tensors([seqs[rows[j]] for j in hot], logits.shape[1])
            q[hot] = filtered_probs(logits[hot].flatten(0, 1), temp, top_k, top_p).view(len(hot), logits.shape[1], -1)
        top1, chain = q.max(-1)  # [n, S]: top1 is a distribution-only input to the plan (see tree_verify)
        if hot:
            owners = [seqs[rows[j]] for j in hot for _ in range(logits.shape[1])]
            chain[hot] = self._sample(q[hot].flatten(0, 1), owners).view(len(hot), -1)
        return q, top1, chain

    def _plan(self, seqs, rows: list[int], top1: torch.Tensor, caps: torch.Tensor):
        """The tree plan over the chain's slots read so far (plan_tree)."""
        conf = self._calibrated(top1)
        auto = self.branch_drafter == "auto"
        rho, lens, alts = self._branch_rates(conf)
        return plan_tree(conf, rho, caps, k=self.tree_k, branch_len=lens,
                         beta=self._beta(), cost=self._tree_cost_model(len(seqs), rows),
                         trim_chain=self.tree_rule == "load_aware" and self.trim_chain, alts=alts,
                         start=self._last_value[self._source if self.branch_drafter in ("first", "joint") else "recovery"],
                         first_rates=[self._alt_rate(w, self._first_obs) for w in range(self.branch_width)] if auto else None,
                         first_start=self._last_value["first"])

    def _branch_rates(self, conf: torch.Tensor):
        """The plan's rates: rho [n, S] of a branch's first token, the longest branch and the
        further alternatives' rates, per slot under "joint" (slot 1 the recovery drafter's
        branch, the rest the first drafter's one-node ranks), else the same at every slot."""
        if self.branch_drafter != "joint":
            return (torch.full_like(conf, self._alt_rate()), self.branch_len,
                    [self._alt_rate(w) for w in range(1, self.branch_width)])
        n, s = conf.shape
        first = [self._alt_rate(w, self._first_obs) for w in range(self.branch_width)]
        mine = [self._alt_rate(w, self._joint_obs) for w in range(self.branch_width)]
        rho = np.full((n, s), first[0])  # the plan is solved on the host (plan_tree)
        rho[:, 0] = mine[0]
        lens = np.ones(s, dtype=np.int64)
        lens[0] = min(self.branch_len, s)
        alts = np.tile(np.asarray(first[1:], dtype=np.float64), (s, 1))
        alts[0] = mine[1:]
        return rho, lens, alts

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

    def _walk(self, seqs, trees: list[TreeRow], fwd: TreeForward) -> list[PathResult]:
        """Each row's accepted path. A greedy row's logits are computed where its walk can read
        them: the chain's nodes, then the branch nodes at the node where the chain stops
        (tree_verify.greedy_reads), in two batched LM-head calls; a sampled row's at every node,
        since its walk may leave the chain at any node."""
        out: list[PathResult | None] = [None] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.req.sampling.greedy]
        if greedy:
            for i, r in zip(greedy, self._greedy_walks([trees[i] for i in greedy], greedy, fwd)):
                out[i] = r
        hot = [i for i, s in enumerate(seqs) if not s.req.sampling.greedy]
        if hot:
            n = max(trees[i].size for i in hot)
            logits = fwd.lm_head(fwd.hidden[torch.tensor(hot, device=self.device), :n])
            for j, i in enumerate(hot):
                seq, tree = seqs[i], trees[i]
                temp, top_k, top_p = self._sampling_tensors([seq], tree.size)
                p = filtered_probs(logits[j, : tree.size], temp, top_k, top_p)
                out[i] = sampling_walk(tree, p, self._generator_of(seq))
        return out

    # up to this many rows (greedy rows x padded tree size) one LM-head call over every node
    # beats the two lazy ones: a call has a large fixed part (embedded pair, one CPU thread: a
    # call of 1-3 rows took 0.16 ms, one of 4-16 rows 0.3-0.6 ms), and few rows are wasted
    ONE_READ_ROWS = 32
    # The LM head reads the chain's first slots only (each slot is a [V, H] product per row):
    # one slot past the longest chain planned in the last CHAIN_REACH_STEPS steps, at most
    # CHAIN_HEAD_SLOTS (all of them until a step was planned). Slots past these are read only
    # when some row's plan keeps its chain to the last slot read, and the plan is then made
    # again over the whole block. A plan that stops short of the slots read is the whole
    # block's plan: the load-aware rule keeps chain slot k only while its survival pays at the
    # plan's price, survival only falls along the chain, and branches sit before the chain's
    # end. So the head's size changes the cost of a step, never its tree.
    CHAIN_HEAD_SLOTS = 8
    CHAIN_REACH_STEPS = 32

    def _greedy_walks(self, trees: list[TreeRow], rows: list[int], fwd: TreeForward) -> list[PathResult]:
        index = torch.tensor(rows, device=self.device)
        n = max(t.size for t in trees)
        if len(rows) * n <= self.ONE_READ_ROWS:
            ids = fwd.lm_head(fwd.hidden[index, :n]).argmax(-1).tolist()
            return [greedy_walk(t, i[: t.size]) for t, i in zip(trees, ids)]
        chain = [t.chain_length for t in trees]
        width = max(chain)
        chain_ids = fwd.lm_head(fwd.hidden[index, :width]).argmax(-1).tolist()
        ids = [c[:n] + [-1] * (t.size - n) for c, n, t in zip(chain_ids, chain, trees)]
        reads = []
        for j, t in enumerate(trees):
            for node in greedy_reads(t, chain_ids[j]):
                if node < width:  # inside the first call's rows already (a row with a shorter chain)
                    ids[j][node] = chain_ids[j][node]
                else:
                    reads.append((j, node))
        if reads:
            at_rows = torch.tensor([rows[j] for j, _ in reads], device=self.device)
            at_nodes = torch.tensor([node for _, node in reads], device=self.device)
            for (j, node), tok in zip(reads, fwd.logits_at(at_rows, at_nodes).argmax(-1).tolist()):
                ids[j][node] = tok
        return [greedy_walk(t, i) for t, i in zip(trees, ids)]

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
