"""The recovery drafter's offline recipe: variable-prefix blocks, their loss, and a short run
that learns from them (tiny models)."""

from __future__ import annotations

import random

import torch

from training_job import d2sd_recovery as rec
from training_job.dflash_offline import IGNORE, DrafterTrainConfig, build_drafter, drafter_forward

MASK = 3


def test_prefix_blocks_hold_true_tokens_and_label_only_the_rest():
    ids = torch.arange(10, 30)[None]  # token at position t is 10 + t
    b = rec.make_prefix_blocks(ids, [20], [[4, 9]], [[2, 5]], 6, MASK)
    assert b.input_ids[0].tolist() == [14, 15, 16, MASK, MASK, MASK]
    assert b.labels[0].tolist() == [IGNORE, IGNORE, IGNORE, 17, 18, 19]
    assert b.input_ids[1].tolist() == [19, 20, 21, 22, 23, 24]
    assert b.labels[1].tolist() == [IGNORE] * 6  # p = 5 = B - 1 leaves nothing to predict
    # context: keys strictly before the anchor, as in DFlash
    assert b.mask[0, 0, 0, :20].nonzero().flatten().tolist() == [0, 1, 2, 3]
    w = rec.prefix_weights(torch.tensor([2]), 6, 7.0)
    torch.testing.assert_close(w[0, 3:], torch.exp(-torch.arange(3.0) / 7.0))
    assert (w[0, :3] == 0).all()


def test_sampled_prefixes_leave_a_label():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(6, 40)
        a = rng.randint(1, n - 3)
        (p,) = rec.sample_prefixes([a], n, 16, rng)
        assert 0 <= p <= 14 and a + p + 1 <= n - 1


def test_continuation_accepts_counts_after_the_prefix():
    labels = torch.tensor([[IGNORE, IGNORE, 5, 6, 7], [IGNORE, 4, 5, 6, 7]])
    props = torch.tensor([[0, 0, 5, 6, 0], [0, 9, 5, 6, 7]])
    assert rec.continuation_accepts(props, labels, torch.tensor([1, 0])).tolist() == [2, 0]


def test_loss_goes_down_on_a_fixed_toy_batch():
    torch.manual_seed(0)
    from transformers import Qwen3Config

    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    d = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4), MASK)
    d.share_target_modules(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    ids = torch.randint(8, 64, (2, 16))
    feats = torch.randn(2, 16, 64)
    prefixes = [[1, 2, 1], [2, 1, 1]]
    b = rec.make_prefix_blocks(ids, [16, 16], [[2, 6, 9], [4, 8, 11]], prefixes, 4, MASK)
    w = rec.prefix_weights(torch.tensor([p for ps in prefixes for p in ps]), 4, 7.0)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = rec.weighted_ce_rows(d.logits(drafter_forward(d, feats, b)), b.labels, w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
