"""Applying a staged version in place, with rollback.

CUDA graphs hold raw pointers to the drafter's weights, so a reload may only overwrite live
tensors, never replace them; and a copy that fails halfway must not leave a mix of versions, so
the old values are snapshotted first and restored on any failure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from .contract import ReloadError
from .staging import TensorSpec


class ReloadTarget(Protocol):
    """What a hot reload writes into. Checkpoint names and live names may differ (SGLang fuses
    q/k/v and shards for tensor parallelism), so the two views are kept apart."""

    def expected(self) -> dict[str, TensorSpec]:
        """Checkpoint name -> (shape, dtype) this target accepts; full coverage required."""
        ...

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """Every live tensor a reload may write (the storage that CUDA graphs point to)."""
        ...

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy a verified checkpoint state into the live tensors, in place."""
        ...

    def refresh(self) -> None:
        """Recompute state derived from the weights (stacked copies, merged embeddings)."""
        ...


class ModuleTarget:
    """A module whose state-dict names are the checkpoint names (the reference drafter, the
    length head, tests). ``prefix`` is stripped from checkpoint names to get module names."""

    def __init__(
        self, module: torch.nn.Module, prefix: str = "", refresh: Callable[[], None] | None = None
    ):
        self.module = module
        self.prefix = prefix
        self._refresh = refresh

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict(keep_vars=True))

    def expected(self) -> dict[str, TensorSpec]:
        return {
            self.prefix + name: (tuple(t.shape), t.dtype) for name, t in self.live_tensors().items()
        }

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        live = self.live_tensors()
        with torch.no_grad():
            for name, value in state.items():
                live[name.removeprefix(self.prefix)].copy_(value, non_blocking=True)

    def refresh(self) -> None:
        if self._refresh is not None:
            self._refresh()


class CompositeTarget:
    """Several targets behind one name space (e.g. SGLang's draft model plus our length head)."""

    def __init__(self, parts: Mapping[str, ReloadTarget]):
        self.parts = dict(parts)  # label -> target; checkpoint names must not overlap

    def expected(self) -> dict[str, TensorSpec]:
        out: dict[str, TensorSpec] = {}
        for part in self.parts.values():
            exp = part.expected()
            clash = set(out) & set(exp)
            if clash:
                raise ValueError(f"reload targets overlap on {sorted(clash)[:3]}")
            out.update(exp)
        return out

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"{label}/{name}": t
            for label, part in self.parts.items()
            for name, t in part.live_tensors().items()
        }

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        for part in self.parts.values():
            keys = part.expected().keys()
            part.write({k: state[k] for k in keys})

    def refresh(self) -> None:
        for part in self.parts.values():
            part.refresh()


class SnapshotBuffers:
    """Host memory for the pre-write copy of every live tensor.

    Allocated by the watcher thread when it stages a version and reused by every reload, so
    the decode thread allocates nothing; pinned when the live tensors are on a GPU, so the
    copies into it are asynchronous and the decode thread never waits for them (the stream
    orders them before the write, and a restore after both). Written once here, too: fresh host
    memory is mapped page by page at its first write, and left to the first swap's copy that
    cost the decode thread a page fault per 4 KB (with the status report's thread start, the
    first swap took 4-5.5 ms against about 2.5 for later ones: benchmarks/reload/).
    """

    def __init__(self, live: Mapping[str, torch.Tensor]):
        self.tensors = {
            name: torch.zeros(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            for name, t in live.items()
        }

    def fits(self, live: Mapping[str, torch.Tensor]) -> bool:
        return live.keys() == self.tensors.keys() and all(
            t.shape == self.tensors[n].shape and t.dtype == self.tensors[n].dtype
            for n, t in live.items()
        )


@dataclass
class Snapshot:
    """Host copies of live tensors taken before a write, and the pointers they had."""

    tensors: dict[str, torch.Tensor]
    live: dict[str, torch.Tensor]
    pointers: dict[str, int]

    @classmethod
    def take(
        cls, live: Mapping[str, torch.Tensor], buffers: SnapshotBuffers | None = None
    ) -> Snapshot:
        with torch.no_grad():
            if buffers is not None and buffers.fits(live):
                copies = buffers.tensors
                for name, t in live.items():
                    copies[name].copy_(t.detach(), non_blocking=True)
            else:  # no buffers prepared: synchronous copies into fresh memory
                copies = {name: t.detach().to("cpu", copy=True) for name, t in live.items()}
        return cls(dict(copies), dict(live), {name: t.data_ptr() for name, t in live.items()})

    def moved(self, live: Mapping[str, torch.Tensor]) -> list[str]:
        """Live tensors that are no longer the storage they were (a reload must never do that)."""
        return sorted(
            name
            for name, ptr in self.pointers.items()
            if name not in live or live[name].data_ptr() != ptr
        )

    def restore(self) -> None:
        # No device sync: later kernels on this stream read the restored values anyway.
        with torch.no_grad():
            for name, t in self.live.items():
                t.copy_(self.tensors[name], non_blocking=True)


def apply_in_place(
    target: ReloadTarget,
    state: Mapping[str, torch.Tensor],
    buffers: SnapshotBuffers | None = None,
) -> Snapshot:
    """Overwrite the target's weights with ``state`` in place; returns the pre-write snapshot.

    On any failure the old values are copied back and :class:`ReloadError` is raised. The caller
    may still restore the snapshot later (e.g. when another tensor-parallel rank failed).
    Everything is queued on the current stream without waiting for the device: it runs between
    two decode steps, and an asynchronous copy error is fatal to the CUDA context anyway, so
    waiting for it here could not roll it back.
    """
    snapshot = Snapshot.take(target.live_tensors(), buffers)
    try:
        target.write(state)
        moved = snapshot.moved(target.live_tensors())
        if moved:
            raise ReloadError(
                f"the reload replaced tensors instead of copying into them ({moved[:3]}); CUDA "
                "graphs would keep reading the old storage"
            )
        target.refresh()
    except Exception as e:
        snapshot.restore()
        target.refresh()
        if isinstance(e, ReloadError):
            raise
        raise ReloadError(
            f"copying the new drafter weights failed ({e!r}); old weights restored"
        ) from e
    return snapshot
