"""An oracle proposer and shared target/drafter fixtures for the engine tests.

The tiny models themselves come from sglang_adaflash.testing.fixtures, so other test folders
build the very same ones.
"""

from __future__ import annotations

import torch

from sglang_adaflash.drafter.model import DFlashDrafter
from sglang_adaflash.target.hf_target import HFTarget


class OracleProposer:
    """Proposes the target's own greedy continuation, corrupted at random slots.

    Gives the engine real multi-token acceptances (which a random drafter never does), so the
    commit/rollback paths are exercised; the drafter's block states feed the length head.
    """

    def __init__(self, target: HFTarget, drafter: DFlashDrafter, error_rate=0.25, seed=0):
        self.target, self.drafter = target, drafter
        self.block_size = drafter.config.block_size
        self.error_rate = error_rate
        self.gen = torch.Generator().manual_seed(seed)
        self.target_layer_ids = []
        self._greedy: dict[tuple, list[int]] = {}  # history prefix -> long greedy continuation

    def move(self, src, dst, length):
        pass

    def release(self, slot):
        pass

    def extend_context(self, *a, **k):
        pass

    def _continuation(self, hist, n):
        """Greedy tokens after hist, from one cached long generate per prompt."""
        for seq in self._greedy.values():
            if len(seq) >= len(hist) + n and seq[: len(hist)] == hist:
                return seq[len(hist): len(hist) + n]
        out = self.target.model.generate(
            torch.tensor([hist]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0].tolist()
        self._greedy[tuple(hist)] = out
        return out[len(hist): len(hist) + n]

    @torch.inference_mode()
    def propose(self, last, ctx_lens, histories, slots=None, read=None):
        """Block states [bs, B, H], or [bs, R, H] at block slots read [bs, R] or a slice (as DFlashProposer)."""
        b, vocab = self.block_size, self.target.vocab_size
        rows = []
        for hist in histories:
            out = torch.tensor(self._continuation(hist, b - 1))
            wrong = torch.rand(b - 1, generator=self.gen) < self.error_rate
            noise = torch.randint(0, vocab, (b - 1,), generator=self.gen)
            rows.append(torch.where(wrong, noise, out))
        self._props = torch.stack(rows)  # [bs, B-1]
        states = torch.randn(len(histories), b, self.drafter.config.hidden_size, generator=self.gen, dtype=torch.float64)
        if read is None:
            return states
        return states[:, read] if isinstance(read, slice) else states.gather(1, read[..., None].expand(-1, -1, states.shape[-1]))

    def proposal_logits(self, hidden, rows, slots):
        logits = torch.full((rows.numel(), self.target.vocab_size), -10.0, dtype=torch.float64)
        return logits.scatter_(1, self._props[rows, slots - 1][:, None], 10.0)

