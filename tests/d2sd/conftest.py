"""An oracle D2SD engine: chain and branches from the target's own greedy continuation, with
corrupted slots, so branches really win and the commit paths through them are exercised."""

from __future__ import annotations

import torch

from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.recovery_drafter import RECOVERY_KEY, recovery_marker
from sglang_adaflash.testing.fixtures import tiny_drafter


def assert_follows_target(target, sp, samples, wrong: bool) -> None:
    """Every position's conditional distribution against the target's (the engine's own
    chi-square): a wrong sampler must be rejected outright, a right one pass a corrected bound."""
    from ..engine.test_lossless_sampling import NEW, _conditional_pvalues

    pvalues = _conditional_pvalues(target, sp, samples)
    if wrong:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-4 / NEW, pvalues


def sampling_models():
    """The small-vocabulary target, first drafter and recovery drafter of the T>0 tests (a
    vocabulary small enough for a chi-square test at every position)."""
    from sglang_adaflash.testing.fixtures import tiny_target

    from ..engine.test_lossless_sampling import BLOCK, VOCAB

    target = tiny_target(seed=5, vocab=VOCAB, layers=2)
    drafter = tiny_drafter(seed=6, vocab=VOCAB, block_size=BLOCK, target_layers=2)
    return target, drafter, recovery_for(drafter, seed=8, vocab=VOCAB, block_size=BLOCK, target_layers=2)


def recovery_for(first, seed=7, **kw):
    """A random drafter shaped like `first`, declared a recovery drafter."""
    rec = tiny_drafter(seed=seed, **kw)
    ada = dict(rec.config.raw.get("adaflash_config") or {})
    ada[RECOVERY_KEY] = recovery_marker()
    rec.config = rec.config.replace(raw={**rec.config.raw, "adaflash_config": ada})
    return rec


class OracleD2SD(D2SDEngine):
    def __init__(self, *a, error_rate=0.3, oracle_seed=0, **kw):
        super().__init__(*a, **kw)
        self.error_rate = error_rate
        self.gen = torch.Generator().manual_seed(oracle_seed)
        self._greedy: dict[tuple, list[int]] = {}
        self._chains: dict[int, list[int]] = {}

    def _continuation(self, hist, n):
        for seq in self._greedy.values():
            if len(seq) >= len(hist) + n and seq[: len(hist)] == hist:
                return seq[len(hist) : len(hist) + n]
        out = self.target.model.generate(torch.tensor([hist]), max_new_tokens=64, min_new_tokens=64,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
        self._greedy[tuple(hist)] = out
        return out[len(hist) : len(hist) + n]

    def _logits(self, right, confident):
        """Right token on top (or second, when corrupted), a confidence that flags corruption."""
        vocab = self.target.vocab_size
        out = torch.zeros(len(right), vocab, dtype=torch.float64)
        for k, tok in enumerate(right):
            if torch.rand((), generator=self.gen) < self.error_rate:
                wrong = (tok + 1 + int(torch.randint(0, vocab - 1, (1,), generator=self.gen))) % vocab
                out[k, wrong], out[k, tok] = 3.0, 2.5
            else:
                out[k, tok] = 9.0 if confident else 4.0
        return out

    def _chain_full_logits(self, seqs, rows):
        """[n, B-1, V]: every slot's logits (tests that bend the oracle override this)."""
        b = self.block_size
        outs = []
        for i in rows:
            hist = seqs[i].req.prompt_ids + seqs[i].output
            outs.append(self._logits(self._continuation(hist, b - 1), True))
            self._chains[i] = outs[-1].argmax(-1).tolist()
        return torch.stack(outs)

    def _chain_logits(self, seqs, rows, upto=None):
        self._chain_full = self._chain_full_logits(seqs, rows)  # the engine's tail read slices it
        return self._chain_full[:, :upto]

    def _chain_tail(self, seqs, rows, start):
        return self._chain_full[:, start:]

    def _branch_logits(self, seqs, block_ids, rows, read):
        b = self.block_size
        outs = []
        for m, i in enumerate(rows):
            ids = block_ids[m].tolist()
            r = int(read[m, 0])  # the branch's slot: its known tokens end before it
            hist = seqs[i].req.prompt_ids + seqs[i].output + ids[1:r]
            cont = self._continuation(hist, b - r)
            out = torch.zeros(b, self.target.vocab_size, dtype=torch.float64)
            out[r:] = self._logits(cont, True)
            outs.append(out[read[m]])
        return torch.stack(outs)

    def _joint_logits(self, seqs, rows, upto=None):
        """--branch-drafter joint: the chain, and the recovery oracle at slots 1..L of the block
        [last token, masks] (the chain's own block)."""
        b, span = self.block_size, min(self.branch_len, self.block_size - 1)
        ids = torch.full((len(rows), b), self.drafter.config.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([seqs[i].last_token for i in rows])
        read = torch.arange(1, 1 + span)[None].expand(len(rows), -1)
        return self._chain_logits(seqs, rows, upto), self._branch_logits(seqs, ids, rows, read)
