"""Per-request KV caches in fixed slots, with commit and rollback by length.

The running batch always occupies slots 0..bs-1, so a step reads `k[:bs, :, :S]` as a view, with
no gather. When a request leaves, the last running request moves into its slot (one copy per
layer). Rollback is free: a slot's valid length is a number, and rejected entries beyond it are
overwritten by the next step before anything reads them.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        # k[layer], v[layer]: [num_slots, kvh, capacity, hd]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.num_slots = num_slots

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int = 0
    ) -> None:
        """Store entries for slots offset..offset+bs-1. positions [bs, Q]; k/v [bs, kvh, Q, hd]."""
        bs = positions.shape[0]
        slots = offset + torch.arange(bs, device=positions.device)[:, None]
        pos = positions.clamp(max=self.capacity - 1)
        self.k[layer][slots, :, pos] = k.transpose(1, 2)
        self.v[layer][slots, :, pos] = v.transpose(1, 2)

    def write_slots(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store entries for the given slots (any order). slots [n]; positions [n, Q]; k/v [n, kvh, Q, hd]."""
        pos = positions.clamp(max=self.capacity - 1)
        self.k[layer][slots[:, None], :, pos] = k.transpose(1, 2)
        self.v[layer][slots[:, None], :, pos] = v.transpose(1, 2)

    def gather(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the given slots' positions 0..length-1: [n, kvh, length, hd]."""
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def write_flat(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store packed entries: slots, positions [T]; k/v [T, kvh, hd]."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def view(
        self, layer: int, bs: int, length: int, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots offset..offset+bs-1, positions 0..length-1: [bs, kvh, length, hd] views."""
        sl = slice(offset, offset + bs)
        return self.k[layer][sl, :, :length], self.v[layer][sl, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Relocate a request's first `length` entries (keeps the running batch contiguous).

        The caller owns the lengths (one number per request serves every cache it has), so no
        cache can hold a stale copy of them.
        """
        if src == dst:
            return
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
