"""Drives a DFlash drafter at decode time: its context cache and one block forward per step."""

from __future__ import annotations

import torch

from ..core.kv_cache import SlotKVCache
from ..drafter.model import DFlashDrafter
from ..target.weight_layout import column_major_linears


class DFlashProposer:
    """Keeps the drafter's per-request context K/V (slots mirror the target cache's)."""

    def __init__(self, drafter: DFlashDrafter, *, num_slots: int, capacity: int):
        cfg = drafter.config
        self.drafter = drafter
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        ref = drafter.fc.weight
        # float32 on a CPU: its projections column-major, as the target's (target.weight_layout);
        # a hot reload copies new values into these tensors, keeping the layout
        self.relaid_linears = column_major_linears(drafter)
        # RoPE's cos and sin at every position the cache holds, read by index (rope_at)
        self.rope_table = drafter.rope(torch.arange(capacity, device=ref.device), ref.dtype)
        self.cache = SlotKVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            num_slots=num_slots,
            capacity=capacity,
            dtype=ref.dtype,
            device=ref.device,
        )

    @torch.inference_mode()
    def extend_context(self, target_hidden: torch.Tensor, starts: torch.Tensor, slots: list[int]) -> None:
        """Append committed tokens' target features for the given cache slots.

        target_hidden [n, A, K*H] lands at positions starts[i] + j of slot slots[i]. Padded rows
        past a request's new tokens land beyond its committed length and are overwritten before
        they are ever read.
        """
        a = target_hidden.shape[1]
        positions = starts[:, None] + torch.arange(a, device=starts.device)[None]
        ctx = self.drafter.project_context(target_hidden)
        write_context(self.cache, self.drafter.context_kv(ctx, positions, self.rope_at(positions)), positions, slots)

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)

    def release(self, slot: int) -> None:
        """The slot is free (its request left); nothing is kept for it here."""

    @torch.inference_mode()
    def propose(
        self, last_tokens: torch.Tensor, ctx_lens: torch.Tensor, histories=None, slots: list[int] | None = None,
        read: torch.Tensor | slice | None = None,
    ) -> torch.Tensor:
        """One drafter forward for the requests in cache slots `slots` (default 0..bs-1).

        last_tokens [bs]; ctx_lens [bs] committed context per request; histories (the committed
        token lists) are unused here but let text-based proposers share the interface. Drafting
        only some of the running requests reads their context by a gather; consecutive
        slots (the whole running batch) read it as a view.
        Returns the block states [bs, B, H] (final normed); proposal_logits turns the slots that
        will be verified into logits. With read [bs, R] (block slots; a slice when every row
        reads the same ones) it returns only those states, [bs, R, H]: the last layer's queries
        and MLP then run on those slots alone, and the states are exactly the full block's at
        them (every slot's K/V is still computed).
        What skips the rest pays when few slots are verified: a 16-slot block's query side is
        most of the drafter's arithmetic, which on a CPU is most of its time.
        """
        embeds, positions, mask, c = self.block_inputs(last_tokens, ctx_lens, mask_one=False)
        return self.drafter(embeds, positions, self.context(self.cache, slots, len(last_tokens), c), mask, read,
                            rope=self.rope_at(positions))

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) [..., hd] at positions, read from the table: the values the drafter
        computes (the same float64 arithmetic, then the cast), in two gathers where computing
        them took about 14 small ops (8 us a call against 27 on the Intel Xeon measured,
        benchmarks/host_ops/; a drafted step makes two).
        Positions past the table read its last row: only a padded row's, whose entries land
        beyond its committed context and are overwritten before they are read (extend_context),
        as the cache's own writes clamp them."""
        index = positions.clamp(max=self.rope_table[0].shape[0] - 1)
        return self.rope_table[0][index], self.rope_table[1][index]

    def block_inputs(self, last_tokens: torch.Tensor, ctx_lens: torch.Tensor, mask_one: bool = True):
        """Each request's block [last token, masks...]: embeddings [bs, B, H], positions [bs, B],
        the mask [bs, 1, B, C+B] (its own committed context, and the whole block) and C.
        With mask_one False a single request gets no mask (None): it sees all C+B keys, and
        attention without a mask is one op where building it took six."""
        bs, b = last_tokens.shape[0], self.block_size
        block_ids = torch.full((bs, b), self.mask_token_id, dtype=torch.long, device=last_tokens.device)
        block_ids[:, 0] = last_tokens
        embeds = self.drafter.embed_tokens(block_ids)
        positions = ctx_lens[:, None] + torch.arange(b, device=ctx_lens.device)[None]
        c = int(ctx_lens.max())
        if bs == 1 and not mask_one:
            return embeds, positions, None, c
        ctx_visible = torch.arange(c, device=ctx_lens.device)[None] < ctx_lens[:, None]  # [bs, C]
        mask = torch.cat([ctx_visible, ctx_visible.new_ones(bs, b)], dim=1)  # [bs, C+B]
        return embeds, positions, mask[:, None, None, :].expand(bs, 1, b, c + b), c

    def context(self, cache: SlotKVCache, slots: list[int] | None, n: int, c: int):
        """Per layer, the first c context K/V of cache slots `slots` (default 0..n-1): views
        when the slots are consecutive (the whole running batch), else a gather."""
        layers = range(len(self.drafter.layers))
        if slots is None or _consecutive(slots):
            first = slots[0] if slots else 0
            return [cache.view(layer, n, c, offset=first) for layer in layers]
        index = torch.tensor(slots, dtype=torch.long, device=cache.k[0].device)
        return [cache.gather(layer, index, c) for layer in layers]

    @torch.inference_mode()
    def proposal_logits(self, hidden: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of block slot slots[j] of request rows[j] (slot k proposes token k)."""
        return self.drafter.logits(hidden[rows, slots])


def write_context(cache: SlotKVCache, kv, positions: torch.Tensor, slots: list[int]) -> None:
    """Per-layer context K/V ([(k, v)], each [n, kvh, A, hd]) at positions [n, A] of cache
    slots `slots`: by slice offset when the slots are consecutive, else scattered."""
    if _consecutive(slots):
        for layer, (k, v) in enumerate(kv):
            cache.write(layer, positions, k, v, offset=slots[0] if slots else 0)
        return
    index = torch.tensor(slots, dtype=torch.long, device=positions.device)
    for layer, (k, v) in enumerate(kv):
        cache.write_slots(layer, index, positions, k, v)


def _consecutive(slots: list[int]) -> bool:
    """Consecutive slots (a view of the cache serves them, no gather or scatter)."""
    return all(b == a + 1 for a, b in zip(slots, slots[1:]))
