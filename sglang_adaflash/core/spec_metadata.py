"""The contract between drafting and verification in one speculative decode step.

Whoever drafts (the reference engine's proposer, a tree builder, a test) fills one
:class:`SpecMetadata`; whoever verifies (:class:`~sglang_adaflash.core.rejection.RejectionSampler`)
reads only it and the target's logits. Keeping the two sides apart by this one object is what
lets a greedy row and a sampled row, a drafted row and one that verifies only its bonus token,
share a batch without either side knowing how the other was produced.

Shapes, with bs rows and K = max(lengths) - 1 proposal slots:

- ``lengths`` [bs] long, on the host: verify length L_i in [1, B]. Slot 0 (the last committed
  token) is included, so row i checks L_i - 1 proposals; L_i = 1 is a plain decode row.
- ``draft_ids`` [bs, K] long, on the device: row i's proposals in its first L_i - 1 slots (the
  rest is padding and never read).
- ``sampled``: the rows that sample (temperature >= SAMPLING_EPS), in ascending order; the
  others are greedy.
- ``draft_probs`` [len(sampled), K, V]: q, the filtered drafter distribution each sampled row's
  proposal was drawn from (None when no row samples or K = 0).
- ``sampling``: the sampled rows' own temperature, top-k, top-p and random streams (None when
  no row samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """Per sampled row (in ``SpecMetadata.sampled`` order): its filter and its random stream."""

    temperature: torch.Tensor  # [n] float
    top_k: torch.Tensor  # [n] long, 0 or >= vocab keeps everything
    top_p: torch.Tensor  # [n] float in (0, 1]
    generators: list[torch.Generator | None] | None = None  # None entries use the shared stream

    def __len__(self) -> int:
        return int(self.temperature.shape[0])

    def repeated(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three filters with each row repeated n times (for [rows * n, V] logits)."""
        return (self.temperature.repeat_interleave(n), self.top_k.repeat_interleave(n),
                self.top_p.repeat_interleave(n))

    @property
    def seeded(self) -> bool:
        return self.generators is not None and any(g is not None for g in self.generators)


@dataclass
class SpecMetadata:
    lengths: torch.Tensor
    draft_ids: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    sampled: list[int] | None = None
    sampling: RowSampling | None = None

    @classmethod
    def plain(cls, bs: int, device) -> SpecMetadata:
        """A plain decode step: nobody drafted, every row verifies its bonus token."""
        return cls(torch.ones(bs, dtype=torch.long), torch.zeros(bs, 0, dtype=torch.long, device=device))

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_proposals(self) -> int:
        """K: proposal slots per row (the longest row's)."""
        return int(self.lengths.max()) - 1 if self.batch_size else 0

    def check(self, vocab_size: int | None = None) -> None:
        """Raise ValueError when the fields disagree with one another (for callers that build
        metadata by hand; the engine's own steps are consistent by construction)."""
        bs, k = self.batch_size, self.num_proposals
        if self.lengths.dtype != torch.long or self.lengths.dim() != 1:
            raise ValueError(f"lengths must be a 1-D long tensor, got {self.lengths.dtype} "
                             f"{tuple(self.lengths.shape)}")
        if bs and int(self.lengths.min()) < 1:
            raise ValueError("every verify length must be >= 1 (slot 0 is always verified)")
        if self.draft_ids is None or tuple(self.draft_ids.shape[:1]) != (bs,) or \
                self.draft_ids.shape[1] < k:
            got = None if self.draft_ids is None else tuple(self.draft_ids.shape)
            raise ValueError(f"draft_ids must be [bs={bs}, >= K={k}], got {got}")
        rows = self.sampled or []
        if sorted(set(rows)) != list(rows) or any(not 0 <= r < bs for r in rows):
            raise ValueError(f"sampled must list distinct rows of [0, {bs}) in order, got {rows}")
        if rows:
            if self.sampling is None or len(self.sampling) != len(rows):
                raise ValueError("sampling must give a filter for every sampled row")
            if self.sampling.generators is not None and len(self.sampling.generators) != len(rows):
                raise ValueError("sampling.generators must have one entry per sampled row")
            if k > 0:
                q = self.draft_probs
                if q is None or q.shape[0] != len(rows) or q.shape[1] < k or \
                        (vocab_size is not None and q.shape[2] != vocab_size):
                    got = None if q is None else tuple(q.shape)
                    raise ValueError(f"draft_probs must be [{len(rows)}, >= {k}, V], got {got}")
