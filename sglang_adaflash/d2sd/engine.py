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
from ..planner.prior import acceptance_prior
from ..target.hf_target import HFTarget
from . import BRANCH_DRAFTERS, TREE_RULES, cascade, joint
from .branch_evidence import BranchEvidence
from .branches import BranchProposals
from .recovery import plan_tree
from .recovery_drafter import TreeProposer, source_limitation
from .tree import TreeRow, build_row, flatten
from .tree_target import TreeForward, commit_paths, gather_nodes, tree_forward
from .tree_verify import PathResult, greedy_reads, greedy_walk, sampling_walk


class D2SDEngine(BranchProposals, BranchEvidence, SpecEngine):
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
            self.posterior.set_prior(acceptance_prior(drafter.manifest, drafter.config.block_size))
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
