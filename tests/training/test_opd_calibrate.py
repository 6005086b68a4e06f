"""The length head's recalibration on held-out records: the fit, the fold, the guard rails."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target
from training_job.opd.calibrate import MIN_EXAMPLES, calibrate_head, fit_platt, head_examples


def _seqs(n, seed=0, vocab=90):
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(3, 6))],
             "output_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(8, 14))]}
            for _ in range(n)]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0).model


def _drafter(target, bias: float):
    d = tiny_drafter(seed=1)
    d.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    with torch.no_grad():
        d.length_head.out.bias.fill_(bias)  # a head that is sure most of the block survives
    return d.eval()


def test_fit_recovers_a_known_scale_and_shift():
    g = torch.Generator().manual_seed(0)
    score = torch.randn(4000, generator=g) * 2
    label = torch.sigmoid(1.7 * score - 0.8)
    a, c = fit_platt(score, label)
    assert a == pytest.approx(1.7, abs=1e-3) and c == pytest.approx(-0.8, abs=1e-3)
    # a decreasing relation is not a calibration: the scale stays positive
    a, _ = fit_platt(score, torch.sigmoid(-score))
    assert a > 0


def test_recalibrate_folds_into_the_output_layer():
    head = tiny_drafter(seed=2).length_head
    x = torch.randn(5, 4, head.down.in_features // 2)
    before = head.logit(x)
    head.recalibrate(0.5, -1.25)
    assert torch.allclose(head.logit(x), 0.5 * before - 1.25, atol=1e-5)
    assert torch.allclose(head(x), torch.sigmoid(0.5 * before - 1.25).float(), atol=1e-6)


def test_calibration_moves_the_mean_to_held_out_acceptance_and_keeps_the_ranking(target):
    drafter = _drafter(target, bias=3.0)
    held = _seqs(12, seed=4)
    kw = dict(pad_id=0, anchors_per_seq=8, batch_size=4, seed=0)
    score, label = head_examples(target, drafter, held, **kw)
    assert score.numel() >= MIN_EXAMPLES
    before = torch.sigmoid(score)
    assert before.mean() - label.mean() > 0.3  # the control: badly biased before
    out = calibrate_head(target, drafter, held, **kw)
    assert out["applied"] and out["blocks"] == score.numel()
    assert out["mse_after"] < out["mse_before"]
    after_score, label2 = head_examples(target, drafter, held, **kw)
    assert torch.equal(label, label2)  # the same blocks (seeded anchors)
    after = torch.sigmoid(after_score)
    assert abs(float(after.mean() - label.mean())) < 0.05
    assert torch.equal(torch.argsort(after_score), torch.argsort(score))


def test_too_few_blocks_leave_the_head_alone(target):
    drafter = _drafter(target, bias=3.0)
    state = {k: v.clone() for k, v in drafter.length_head.state_dict().items()}
    out = calibrate_head(target, drafter, _seqs(2, seed=5), pad_id=0, anchors_per_seq=2,
                         batch_size=4, seed=0)
    assert not out["applied"] and "fewer than" in out["reason"]
    assert all(torch.equal(v, drafter.length_head.state_dict()[k]) for k, v in state.items())


def test_no_head_no_calibration(target):
    plain = tiny_drafter(seed=1, head=False)
    assert calibrate_head(target, plain, _seqs(12), pad_id=0, anchors_per_seq=8, batch_size=4,
                          seed=0) == {"applied": False, "reason": "no length head"}
