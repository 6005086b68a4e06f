"""The second drafter: a variable-prefix DFlash drafter, its checkpoint check and its forward.

Architecture and weights are a DFlash drafter's (same modules, names and config keys), so the
file format is the published one. What differs is the block it was trained to fill: slots
0..r hold known tokens (the last committed token, then r tokens assumed to follow it) and slots
r+1..B-1 mask tokens; it predicts slots r+1.. given the target's context features of the
committed tokens and the known slots (block attention is bidirectional, as in DFlash). The
engine uses it to continue a recovery branch: the known slots are the first drafter's chain
up to slot r-1 and the alternative token chosen for slot r.

A recovery checkpoint declares itself in config.json under
`adaflash_config.recovery_drafter` = {"format": 1, "prefix": "variable", ...}, and must read
the same target layers with the same block size, mask token and sizes as the first drafter it
serves with (the engine captures one set of target features for both).
"""

from __future__ import annotations

import os

import torch

from ..core.kv_cache import SlotKVCache
from ..drafter.checkpoint import CheckpointError, load_drafter, read_config
from ..drafter.model import DFlashDrafter
from ..engine.proposer import DFlashProposer, _consecutive

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
    for name in _MATCH:
        a, b = getattr(cfg, name), getattr(first.config, name)
        if a != b:
            raise CheckpointError(
                f"{where}: {name} is {a}, the first drafter's is {b}; a recovery drafter must be trained "
                "for the same target features and block as the drafter it serves with"
            )


def load_recovery_drafter(path: str | os.PathLike, first: DFlashDrafter, *, dtype=None, device="cpu") -> DFlashDrafter:
    """Loads and checks a recovery checkpoint against the first drafter. Raises CheckpointError."""
    if not os.path.isdir(path):
        raise CheckpointError(f"recovery drafter {path} does not exist or is not a directory")
    cfg = read_config(path)  # a missing or broken config.json fails here, before any weights
    check_recovery_config(cfg, first, str(path))
    return load_drafter(path, dtype=dtype or first.fc.weight.dtype, device=device)


class TreeProposer(DFlashProposer):
    """The first drafter's proposer, plus the recovery drafter's own context cache.

    Both drafters read the same committed target features; extend_context and move keep the two
    caches in step, so the engine's prefill, catch-up and retirement paths serve both. Without a
    recovery drafter (trees from the first drafter alone) it is the first drafter's proposer.
    """

    def __init__(self, drafter: DFlashDrafter, recovery: DFlashDrafter | None, *, num_slots: int, capacity: int):
        super().__init__(drafter, num_slots=num_slots, capacity=capacity)
        self.recovery, self.rcache = recovery, None
        if recovery is None:
            return
        cfg = recovery.config
        self.recovery = recovery
        ref = recovery.fc.weight
        self.rcache = SlotKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                  num_slots=num_slots, capacity=capacity, dtype=ref.dtype, device=ref.device)

    @torch.inference_mode()
    def extend_context(self, target_hidden, starts, slots) -> None:
        super().extend_context(target_hidden, starts, slots)
        if self.recovery is None:
            return
        a = target_hidden.shape[1]
        positions = starts[:, None] + torch.arange(a, device=starts.device)[None]
        kv = self.recovery.context_kv(self.recovery.project_context(target_hidden), positions)
        if _consecutive(slots):
            for layer, (k, v) in enumerate(kv):
                self.rcache.write(layer, positions, k, v, offset=slots[0] if slots else 0)
            return
        index = torch.tensor(slots, dtype=torch.long, device=positions.device)
        for layer, (k, v) in enumerate(kv):
            self.rcache.write_slots(layer, index, positions, k, v)

    def move(self, src: int, dst: int, length: int) -> None:
        super().move(src, dst, length)
        if self.rcache is not None:
            self.rcache.move(src, dst, length)

    @torch.inference_mode()
    def propose_branches(self, block_ids: torch.Tensor, ctx_lens: torch.Tensor, slots: torch.Tensor,
                         read: torch.Tensor | None = None) -> torch.Tensor:
        """One recovery-drafter forward over every branch: block_ids [m, B] (known slots then
        masks), ctx_lens [m] and cache slots [m] (repeats allowed) -> block states [m, B, H],
        or [m, R, H] at the block slots read [m, R] (DFlashDrafter.forward)."""
        m, b = block_ids.shape
        embeds = self.recovery.embed_tokens(block_ids)
        positions = ctx_lens[:, None] + torch.arange(b, device=ctx_lens.device)[None]
        c = int(ctx_lens.max())
        ctx_visible = torch.arange(c, device=ctx_lens.device)[None] < ctx_lens[:, None]
        mask = torch.cat([ctx_visible, ctx_visible.new_ones(m, b)], dim=1)[:, None, None, :].expand(m, 1, b, c + b)
        ctx_kv = [self.rcache.gather(layer, slots, c) for layer in range(len(self.recovery.layers))]
        return self.recovery(embeds, positions, ctx_kv, mask, read)
