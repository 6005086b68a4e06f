"""The second drafter: a variable-prefix DFlash drafter, its checkpoint check and its forward.

Architecture and weights are a DFlash drafter's (same modules, names and config keys), so the
file format is the published one. What differs is the block it was trained to fill: slots
0..r hold known tokens (the last committed token, then r tokens assumed to follow it) and slots
r+1..B-1 mask tokens; it predicts slots r+1.. given the target's context features of the
committed tokens and the known slots (block attention is bidirectional, as in DFlash). The
engine uses it to continue a recovery branch: the known slots are the first drafter's chain
up to slot r-1 and the alternative token chosen for slot r.

A recovery checkpoint declares itself in config.json under
`adaflash_config.recovery_drafter` = {"format": 1, "prefix": "variable", ...}; its optional
`prefix_range` [0, P] says which prefixes it was trained on (P = 0: the slot-1 branch alone, all
that `--branch-drafter joint` asks of it). It must read
the same target layers with the same block size, mask token and sizes as the first drafter it
serves with (the engine captures one set of target features for both).
"""

from __future__ import annotations

import os

import torch

from ..core.kv_cache import SlotKVCache
from ..drafter.checkpoint import CheckpointError, load_drafter, read_config
from ..drafter.model import DFlashDrafter
from ..engine.proposer import DFlashProposer, write_context
from .joint import JointDrafters
from .shared_context import SHARING, sharing, tie_modules

RECOVERY_KEY = "recovery_drafter"
RECOVERY_FORMAT = 1
_MATCH = ("hidden_size", "vocab_size", "mask_token_id", "target_layer_ids", "block_size", "num_target_layers")


def recovery_marker(**info) -> dict:
    """What a trained recovery drafter writes under adaflash_config (see the module docstring)."""
    return {"format": RECOVERY_FORMAT, "prefix": "variable", **info}


def check_recovery_config(cfg, first, where: str) -> None:
    ada = cfg.raw.get("adaflash_config") or {}
    marker = ada.get(RECOVERY_KEY)
    if not isinstance(marker, dict):
        raise CheckpointError(
            f"{where} is not a recovery drafter: its config.json has no adaflash_config.{RECOVERY_KEY}; "
            "a plain DFlash drafter was never trained on variable prefixes (train one with "
            "`python -m training_job.d2sd_recovery`)"
        )
    if marker.get("format") != RECOVERY_FORMAT or marker.get("prefix") != "variable":
        raise CheckpointError(
            f"{where}: adaflash_config.{RECOVERY_KEY} is {marker!r}; this engine reads format "
            f"{RECOVERY_FORMAT} with prefix 'variable'"
        )
    span = marker.get("prefix_range")
    if span is not None and not (isinstance(span, list) and len(span) == 2
                                 and all(isinstance(x, int) and not isinstance(x, bool) for x in span)
                                 and span[0] == 0 and 0 <= span[1] <= cfg.block_size - 2):
        raise CheckpointError(f"{where}: adaflash_config.{RECOVERY_KEY}.prefix_range is {span!r}; this engine "
                              f"reads [0, P] with 0 <= P <= block_size - 2 = {cfg.block_size - 2}")
    shared = marker.get("shared")
    if shared is not None and shared not in SHARING:
        raise CheckpointError(f"{where}: adaflash_config.{RECOVERY_KEY}.shared is {shared!r}; this engine "
                              f"reads one of {', '.join(SHARING)} (or no key: nothing shared)")
    match = _MATCH + (("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "intermediate_size") if shared is not None else ())
    for name in match:
        a, b = getattr(cfg, name), getattr(first.config, name)
        if a != b:
            raise CheckpointError(
                f"{where}: {name} is {a}, the first drafter's is {b}; a recovery drafter must be trained "
                "for the same target features and block as the drafter it serves with"
            )


def prefix_limit(cfg) -> int:
    """The longest prefix the checkpoint was trained on: its prefix_range's end, else the block's."""
    marker = (cfg.raw.get("adaflash_config") or {}).get(RECOVERY_KEY) or {}
    span = marker.get("prefix_range")
    return cfg.block_size - 2 if span is None else int(span[1])


def source_limitation(branch_drafter: str, recovery: DFlashDrafter | None) -> str | None:
    """Why this recovery drafter cannot serve that branch source, or None.

    Sources "recovery" and "auto" may branch at any chain slot r, a prefix of r - 1 tokens; a
    checkpoint trained on shorter prefixes only would be asked for blocks it never saw (still
    lossless, since the target verifies every node, but its branches would be guesses).
    "joint" asks for the slot-1 branch alone (prefix 0), which every checkpoint covers."""
    if recovery is None or branch_drafter not in ("recovery", "auto"):
        return None
    top, most = prefix_limit(recovery.config), recovery.config.block_size - 2
    if top >= most:
        return None
    return (f"it was trained on prefixes 0..{top} only (prefix_range [0, {top}]: branches at chain slots "
            f"1..{top + 1}), and --branch-drafter {branch_drafter} branches at any slot up to {most + 1}; "
            "serve it with --branch-drafter joint, or train one with a longer --max-prefix")


def load_recovery_drafter(path: str | os.PathLike, first: DFlashDrafter, *, dtype=None, device="cpu") -> DFlashDrafter:
    """Loads and checks a recovery checkpoint against the first drafter. Raises CheckpointError.

    A checkpoint marked `"shared": KIND` was trained with the first drafter's modules of that
    kind frozen (training_job.d2sd_recovery --share KIND, shared_context.py): they are tied to
    the first drafter's here."""
    if not os.path.isdir(path):
        raise CheckpointError(f"recovery drafter {path} does not exist or is not a directory")
    cfg = read_config(path)  # a missing or broken config.json fails here, before any weights
    check_recovery_config(cfg, first, str(path))
    recovery = load_drafter(path, dtype=dtype or first.fc.weight.dtype, device=device)
    kind = ((cfg.raw.get("adaflash_config") or {}).get(RECOVERY_KEY) or {}).get("shared")
    if kind is not None:
        tie_modules(recovery, first, kind)
    return recovery


class TreeProposer(DFlashProposer):
    """The first drafter's proposer, plus the recovery drafter's own context cache.

    Both drafters read the same committed target features, and the engine's prefill, catch-up
    and retirement paths reach both through extend_context and move. The recovery drafter's
    cache is brought up to date lazily: extend_context queues the features per slot, and the
    queue is projected in one batched call when a recovery forward reads that slot
    (propose_branches), or once any queue holds FLUSH_AFTER entries (bounded memory). A step
    whose plan takes no recovery branch (`--branch-drafter auto` at low load, mostly) then
    pays nothing for the second drafter's context. The cache ends up as eager writes would
    leave it at every committed position. Without a recovery drafter it is the first drafter's
    proposer.
    """

    FLUSH_AFTER = 64

    def __init__(self, drafter: DFlashDrafter, recovery: DFlashDrafter | None, *, num_slots: int, capacity: int,
                 joint: bool = False):
        """joint: the two drafters run as one stacked forward (joint.py, `--branch-drafter
        joint`); both contexts are then written eagerly, by one stacked projection."""
        super().__init__(drafter, num_slots=num_slots, capacity=capacity)
        self.recovery, self.rcache = recovery, None
        self.joint = JointDrafters(drafter, recovery) if joint else None
        # slot -> [(start, features [A, K*H])], contiguous in position: not yet in rcache
        self._lag: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.lag_flushes = 0  # batched catch-up calls (tests and benchmarks read it)
        # a recovery drafter with the first's context modules (shared_context.py) reads its cache
        self.shared_context = sharing(drafter, recovery) is not None
        if recovery is None:
            return
        if self.shared_context:
            self.rcache = self.cache
            return
        cfg = recovery.config
        ref = recovery.fc.weight
        self.rcache = SlotKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                  num_slots=num_slots, capacity=capacity, dtype=ref.dtype, device=ref.device)

    @torch.inference_mode()
    def extend_context(self, target_hidden, starts, slots) -> None:
        if self.shared_context:  # one cache for both
            super().extend_context(target_hidden, starts, slots)
            return
        if self.joint is not None:
            self._extend_both(target_hidden, starts, slots)
            return
        super().extend_context(target_hidden, starts, slots)
        if self.recovery is None or target_hidden.shape[1] == 0:  # nothing written, nothing overwritten
            return
        # A call at `start` ends each slot's committed context by start + A (its later rows are
        # padding); the engine's calls all do. Queued rows from `start` on are dropped.
        for slot, start, feats in zip(slots, starts.tolist(), target_hidden):
            queue = self._lag.setdefault(slot, [])
            while queue and queue[-1][0] >= start:  # overwritten from `start` on (a rollback or a new request)
                queue.pop()
            if queue:
                s0, f0 = queue[-1]
                if s0 + f0.shape[0] < start:  # a gap (not made by the engine): write what is queued first
                    self.catch_up([slot])
                    queue = self._lag.setdefault(slot, [])
                else:
                    # its rows from `start` on were padding or rejected; a copy frees the step's batch tensor
                    queue[-1] = (s0, f0[: start - s0].clone())
            queue.append((start, feats))
        if any(len(q) >= self.FLUSH_AFTER for q in self._lag.values()):
            self.catch_up(list(self._lag))

    def _extend_both(self, target_hidden, starts, slots) -> None:
        """Both drafters' context K/V from one stacked projection, written at once."""
        a = target_hidden.shape[1]
        if a == 0:
            return
        positions = starts[:, None] + torch.arange(a, device=starts.device)[None]
        for cache, kv in zip((self.cache, self.rcache), self.joint.context_kv(target_hidden, positions)):
            write_context(cache, kv, positions, slots)

    @torch.inference_mode()
    def propose_joint(self, last_tokens: torch.Tensor, ctx_lens: torch.Tensor, slots: list[int],
                      recovery_rows: slice | None = None):
        """Both drafters over the block [last token, masks...] of each request in cache slots
        `slots`, in one stacked forward -> (first's, recovery's) block states, each [n, B, H]
        (the recovery drafter's at block rows `recovery_rows` only, when given)."""
        embeds, positions, mask, c = self.block_inputs(last_tokens, ctx_lens)
        n = len(last_tokens)
        ctx_first = self.context(self.cache, slots, n, c)
        ctx_rec = ctx_first if self.shared_context else self.context(self.rcache, slots, n, c)
        return self.joint.forward(embeds, positions, ctx_first, ctx_rec, mask, recovery_rows)

    @torch.inference_mode()
    def catch_up(self, slots) -> None:
        """Project the queued features of these slots into the recovery cache, in one call.

        The rows are packed, not padded: the projection and K/V are per token, so a long prompt
        in one slot costs nothing for the others."""
        rows = [(slot, self._lag.pop(slot)) for slot in dict.fromkeys(slots) if self._lag.get(slot)]
        if not rows:
            return
        feats = torch.cat([f for _, queue in rows for _, f in queue])  # [T, K*H]
        device = feats.device
        spans = [(slot, queue[0][0], sum(f.shape[0] for _, f in queue)) for slot, queue in rows]
        positions = torch.cat([torch.arange(start, start + n, device=device) for _, start, n in spans])
        index = torch.cat([torch.full((n,), slot, dtype=torch.long, device=device) for slot, _, n in spans])
        pos = positions.clamp(max=self.rcache.capacity - 1)  # padding past capacity is never committed
        kv = self.recovery.context_kv(self.recovery.project_context(feats[None]), positions[None])
        for layer, (k, v) in enumerate(kv):  # [1, kvh, T, hd]
            self.rcache.write_flat(layer, index, pos, k[0].transpose(0, 1), v[0].transpose(0, 1))
        self.lag_flushes += 1

    def release(self, slot: int) -> None:
        """The request in this slot left: its queued features are dropped, not kept alive."""
        self._lag.pop(slot, None)

    def move(self, src: int, dst: int, length: int) -> None:
        super().move(src, dst, length)
        if self.rcache is None or self.shared_context or src == dst:
            return
        self.rcache.move(src, dst, length)
        self._lag.pop(dst, None)
        queue = self._lag.pop(src, None)
        if queue:
            self._lag[dst] = queue  # positions before its first start came with rcache.move

    @torch.inference_mode()
    def propose_branches(self, block_ids: torch.Tensor, ctx_lens: torch.Tensor, slots: torch.Tensor,
                         read: torch.Tensor | None = None) -> torch.Tensor:
        """One recovery-drafter forward over every branch: block_ids [m, B] (known slots then
        masks), ctx_lens [m] and cache slots [m] (repeats allowed) -> block states [m, B, H],
        or [m, R, H] at the block slots read [m, R] (DFlashDrafter.forward)."""
        m, b = block_ids.shape
        if self._lag:
            self.catch_up(slots.tolist())
        embeds = self.recovery.embed_tokens(block_ids)
        positions = ctx_lens[:, None] + torch.arange(b, device=ctx_lens.device)[None]
        c = int(ctx_lens.max())
        ctx_visible = torch.arange(c, device=ctx_lens.device)[None] < ctx_lens[:, None]
        mask = torch.cat([ctx_visible, ctx_visible.new_ones(m, b)], dim=1)[:, None, None, :].expand(m, 1, b, c + b)
        ctx_kv = [self.rcache.gather(layer, slots, c) for layer in range(len(self.recovery.layers))]
        return self.recovery(embeds, positions, ctx_kv, mask, read)
