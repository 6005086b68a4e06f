from __future__ import annotations

import torch

from training_job.target_lm import (
    TargetConfig,
    WindowSampler,
    lr_at,
    make_model,
    pack,
)


def test_loss_goes_down_on_a_fixed_toy_batch():
    torch.manual_seed(0)
    cfg = TargetConfig.toy()
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(8, cfg.vocab_size, (2, 32))
    losses = []
    for _ in range(30):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_pack_and_sampler_are_deterministic():
    docs = [[1, 2, 3, 4, 5]] * 10 + [[6, 7]] * 10
    w1, w2 = pack(docs, 8, seed=1), pack(docs, 8, seed=1)
    assert torch.equal(w1, w2) and w1.shape == (8, 8)
    s = WindowSampler(w1, batch_size=3, seed=2)
    assert torch.equal(s.batch(5), WindowSampler(w1, 3, 2).batch(5))
    assert s.batch(0).shape == (3, 8)


def test_lr_schedule_warms_up_then_decays():
    cfg = TargetConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, cfg) == 0.1
    assert abs(lr_at(10, cfg) - 1.0) < 1e-9
    assert abs(lr_at(100, cfg) - 0.1) < 1e-9
    assert lr_at(50, cfg) < lr_at(20, cfg)
