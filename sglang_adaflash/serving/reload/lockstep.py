"""Tensor-parallel lockstep: ranks swap on the same step, and all keep or all roll back.

Each tensor-parallel rank holds a shard of the drafter; a step that mixed versions across ranks
would compute garbage, so every decision to swap or keep is a collective minimum.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LockstepGroup(Protocol):
    size: int

    def all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over all ranks; every rank must call it at the same step."""
        ...


class SingleRank:
    size = 1

    def all_min(self, values: list[int]) -> list[int]:
        return list(values)


class TorchDistGroup:
    """``all_reduce(MIN)`` over a CPU (gloo) process group, e.g. SGLang's TP ``cpu_group``."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.size = dist.get_world_size(group)

    def all_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return t.tolist()
