"""What a verify step hands back: each request's committed tokens and its accepted count.

Its own module so that both verifiers (the torch one in core.rejection and FlashInfer's fused
kernel in core.flashinfer_sampling, which rejection dispatches to) build it without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER = -1  # pads VerifyResult.tokens past each request's committed tokens


@dataclass
class VerifyResult:
    # [bs, K+1] committed tokens per request, padded with PLACEHOLDER
    tokens: torch.Tensor
    # [bs] accepted proposals per request (tau = num_accepted + 1)
    num_accepted: torch.Tensor

    def to_lists(self) -> list[list[int]]:
        # one device->host read: the counts ride in a last column (row[: n + 1] never reaches it)
        rows = torch.cat([self.tokens, self.num_accepted[:, None].to(self.tokens.dtype)], 1).tolist()
        return [row[: row[-1] + 1] for row in rows]
