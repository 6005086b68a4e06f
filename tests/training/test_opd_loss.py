"""The OPD loss: reverse KL, entry-wise clipping after normalisation, CE on the target's argmax;
the reference's normalisation (decayed-weight sum, T^2) and ours (slot count) as an option; the
forward-KL variant and the OSD (sft) baseline."""

from __future__ import annotations

import math

import pytest
import torch

from training_job.block_losses import IGNORE, position_weights, weighted_ce
from training_job.opd.loss import (
    NORM_EPS,
    denominators,
    forward_kl,
    opd_loss,
    osd_loss,
    reverse_kl,
)

V = 6


def _case(seed=0, n=3, b=5):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(n, b, V, generator=g, dtype=torch.float64) * 2
    t = torch.randn(n, b, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (n, b), generator=g)
    labels[:, 0] = IGNORE
    labels[-1, 3:] = IGNORE  # a block that runs past its sequence
    return d.requires_grad_(), t, labels


def test_reverse_kl_is_kl_of_drafter_from_target():
    p_d = torch.tensor([0.9, 0.09, 0.01], dtype=torch.float64)
    p_t = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    want = float((p_d * (p_d / p_t).log()).sum())
    forward = float((p_t * (p_t / p_d).log()).sum())
    assert abs(want - forward) > 0.1  # the two directions differ here
    got = reverse_kl(p_d.log()[None, None], p_t.log()[None, None])
    assert got.item() == pytest.approx(want, rel=1e-5)
    # temperature divides both logit sets
    hot = reverse_kl(p_d.log()[None, None], p_t.log()[None, None], temperature=2.0)
    q_d, q_t = p_d.sqrt() / p_d.sqrt().sum(), p_t.sqrt() / p_t.sqrt().sum()
    assert hot.item() == pytest.approx(float((q_d * (q_d / q_t).log()).sum()), rel=1e-5)


def test_forward_kl_is_kl_of_target_from_drafter():
    p_d = torch.tensor([0.9, 0.09, 0.01], dtype=torch.float64)
    p_t = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    # by hand: 0.2 ln(0.2/0.9) + 0.3 ln(0.3/0.09) + 0.5 ln(0.5/0.01)
    want = 0.2 * math.log(0.2 / 0.9) + 0.3 * math.log(0.3 / 0.09) + 0.5 * math.log(0.5 / 0.01)
    assert want == pytest.approx(2.0164, abs=1e-4)
    got = forward_kl(p_d.log()[None, None], p_t.log()[None, None])
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert reverse_kl(p_d.log()[None, None], p_t.log()[None, None]).item() != \
        pytest.approx(want, rel=1e-2)


def test_fkl_loss_by_hand_with_a_clipped_entry():
    """One block, two valid slots (N = 2), alpha 0.5, tau 0.5, uniform target over 2 tokens.
    Slot 1: drafter (0.9, 0.1): FKL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5108, share 0.2554.
    Slot 2: drafter (0.01, 0.99): FKL = 1.6195, share 0.8098 > tau -> tau, no gradient.
    CE on the target argmax (token 0, the first of a tie): -ln 0.9 and -ln 0.01."""
    d = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.01, 0.99]]], dtype=torch.float64).log()
    d.requires_grad_()
    t = torch.zeros(1, 3, 2, dtype=torch.float64)
    labels = torch.tensor([[IGNORE, 1, 1]])
    w = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)
    parts = opd_loss(d, t, labels, w, alpha=0.5, tau=0.5, divergence="fkl", kl_norm=2.0)
    fkl1 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    fkl2 = 0.5 * math.log(0.5 / 0.01) + 0.5 * math.log(0.5 / 0.99)
    assert fkl1 / 2 < 0.5 < fkl2 / 2
    ce = (1.0 * -math.log(0.9) + 0.5 * -math.log(0.01)) / 1.5
    soft = 1.0 * fkl1 / 2 + 0.5 * 0.5
    assert parts.loss.item() == pytest.approx(0.5 * ce + 0.5 * soft, rel=1e-6)  # KL in float32
    assert parts.kl.item() == pytest.approx(soft, rel=1e-6) and int(parts.clipped) == 1
    # slot 2's gradient is the CE term's alone (clipping sends nothing from the KL); slot 1's
    # is not
    parts.loss.backward()
    d2 = d.detach().clone().requires_grad_()
    (0.5 * opd_loss(d2, t, labels, w, alpha=1.0).loss).backward()
    assert torch.allclose(d.grad[0, 2], d2.grad[0, 2], atol=1e-12)
    assert not torch.allclose(d.grad[0, 1], d2.grad[0, 1], atol=1e-6)
    with pytest.raises(ValueError, match="divergence"):
        opd_loss(d, t, labels, w, divergence="js")


def test_fkl_and_rkl_share_the_ce_term_and_differ_in_the_soft_one():
    d, t, labels = _case(3)
    w = position_weights(5, 7.0)
    count = (labels != IGNORE).sum()
    r = opd_loss(d, t, labels, w, alpha=0.8, tau=1e9, kl_norm=count)
    f = opd_loss(d, t, labels, w, alpha=0.8, tau=1e9, divergence="fkl", kl_norm=count)
    assert r.ce.item() == pytest.approx(f.ce.item(), rel=1e-12)
    want = (w[None] * forward_kl(d, t) / count * (labels != IGNORE)).sum()
    assert f.kl.item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(f.kl.item() - r.kl.item()) > 1e-3


def test_clipping_is_entrywise_and_after_normalisation():
    """Four valid slots, normalised by their count (N = 4, ``kl_norm``), tau = 0.1. Slot 1: KL 2.0, share 0.5 > tau -> clipped, no
    gradient. Slot 2: KL 0.3 > tau but share 0.075 < tau -> not clipped, gets a gradient."""
    b = 5
    t = torch.zeros(1, b, V, dtype=torch.float64)
    d = torch.zeros(1, b, V, dtype=torch.float64)

    def logits_with_kl(target_kl):
        # drafter = target with a bump on token 0 sized to give the wanted reverse KL
        lo, hi = 0.0, 20.0
        for _ in range(80):
            mid = (lo + hi) / 2
            x = torch.zeros(1, 1, V, dtype=torch.float64)
            x[..., 0] = mid
            if reverse_kl(x, torch.zeros_like(x)).item() < target_kl:
                lo = mid
            else:
                hi = mid
        x = torch.zeros(V, dtype=torch.float64)
        x[0] = lo
        return x

    d[0, 1] = logits_with_kl(2.0)
    d[0, 2] = logits_with_kl(0.3)
    d[0, 3] = logits_with_kl(0.01)
    d[0, 4] = logits_with_kl(0.01)
    d.requires_grad_()
    labels = torch.tensor([[IGNORE, 1, 1, 1, 1]])
    w = position_weights(b, 7.0)
    parts = opd_loss(d, t, labels, w, alpha=0.0, tau=0.1, kl_norm=4.0)
    parts.loss.backward()
    g = d.grad[0].abs().sum(-1)
    assert g[1].item() == 0.0
    assert g[2].item() > 0 and g[3].item() > 0
    assert int(parts.clipped) == 1
    kl = reverse_kl(d.detach(), t)[0]
    want = w[1] * 0.1 + sum(w[k] * kl[k] / 4 for k in (2, 3, 4))
    assert parts.loss.item() == pytest.approx(float(want), rel=1e-6)


def test_ce_term_uses_the_target_argmax_with_position_decay():
    d, t, labels = _case()
    w = position_weights(5, 7.0)
    assert w[0] == 0 and w[2].item() == pytest.approx(math.exp(-1 / 7))
    greedy = t.argmax(-1).masked_fill(labels == IGNORE, IGNORE)
    assert (greedy != labels).any()  # the data tokens differ from the target's argmax here
    parts = opd_loss(d, t, labels, w, alpha=1.0)
    assert parts.loss.item() == pytest.approx(weighted_ce(d, greedy, w).item(), rel=1e-6)
    mixed = opd_loss(d, t, labels, w, alpha=0.8, tau=1e9)
    wsum = (w[None] * (labels != IGNORE)).sum()  # the reference's N (decayed-weight sum)
    rkl = (w[None] * reverse_kl(d, t) / wsum * (labels != IGNORE)).sum()
    want = 0.8 * weighted_ce(d, greedy, w) + 0.2 * rkl
    assert mixed.loss.item() == pytest.approx(want.item(), rel=1e-6)


def test_osd_is_weighted_ce_on_the_response_tokens():
    d, _, labels = _case(1)
    w = position_weights(5, 7.0)
    assert osd_loss(d, labels, w).loss.item() == pytest.approx(weighted_ce(d, labels, w).item())


@pytest.mark.parametrize("algorithm", ["rkl", "fkl", "sft"])
@pytest.mark.parametrize("norm", ["weights", "count"])
def test_shards_with_global_denominators_sum_to_the_whole_batch(algorithm, norm):
    """What data-parallel ranks rely on: per-rank losses with the global denominators have
    gradients that add up to the single-process gradient (clipping included)."""
    d, t, labels = _case(2, n=6)
    w = position_weights(5, 7.0)
    count, wsum = denominators(labels, w)
    ce_norm = wsum + NORM_EPS
    kl_norm = ce_norm if norm == "weights" else count

    def loss(dl, tl, lab):
        if algorithm != "sft":
            return opd_loss(dl, tl, lab, w, tau=0.05, divergence=algorithm, ce_norm=ce_norm,
                            kl_norm=kl_norm).loss
        return osd_loss(dl, lab, w, ce_norm=ce_norm).loss

    loss(d, t, labels).backward()
    whole = d.grad.clone()
    d.grad = None
    for part in (slice(0, 2), slice(2, 6)):
        loss(d[part], t[part], labels[part]).backward()
    assert torch.allclose(d.grad, whole, atol=1e-12)


def test_per_sequence_groups_average_the_sequences_own_losses():
    """scope "sequence": every block row carries its own sequence's denominator and the loss is
    the mean over sequences, i.e. the mean of each sequence's loss computed alone."""
    d, t, labels = _case(4, n=5)
    w = position_weights(5, 7.0)
    seq = torch.tensor([0, 0, 1, 1, 1])
    alone = [opd_loss(d[seq == s], t[seq == s], labels[seq == s], w, tau=0.05).loss
             for s in (0, 1)]
    per_row = torch.stack([denominators(labels[seq == s], w)[1] for s in (0, 1)])[seq]
    both = opd_loss(d, t, labels, w, tau=0.05, ce_norm=per_row + NORM_EPS,
                    kl_norm=per_row + NORM_EPS, groups=2)
    assert both.loss.item() == pytest.approx((alone[0] + alone[1]).item() / 2, rel=1e-9)


def test_reference_objective_by_hand():
    """The AdaFlash reference's loss on one block, no hidden states, every number by hand.

    Block of 3 (slot 0 unlabelled), gamma 1: w = (1, e^-1 = 0.367879); N = 1.367880 (+1e-6).
    Vocabulary of 2, temperature T = 2, target uniform at both slots (argmax: token 0).
    Drafter logits 2 ln q, so at T = 2 its distribution is q: slot 1 q = (0.8, 0.2), slot 2
    q = (0.1, 0.9); at T = 1 it is q^2 normalised: p(token 0) = 0.64/0.68 and 0.01/0.82.
      CE   = (1 * -ln 0.941176 + 0.367879 * -ln 0.012195) / N
           = (0.060625 + 1.621140) / 1.367880                             = 1.229469
      RKL  = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.192745;  0.1 ln 0.2 + 0.9 ln 1.8 = 0.368064
      kd   = RKL * T^2 / N = 0.563630 and 1.076305; tau 0.6 clips slot 2
      soft = 1 * 0.563630 + 0.367879 * 0.6                                = 0.784358
      loss = 0.8 * 1.229469 + 0.2 * 0.784358                              = 1.140446
    Ours (count 2, no T^2) would give 1.016390: the test tells the two apart.
    """
    q = torch.tensor([[[0.5, 0.5], [0.8, 0.2], [0.1, 0.9]]], dtype=torch.float64)
    d = (2 * q.log()).requires_grad_()
    t = torch.zeros(1, 3, 2, dtype=torch.float64)
    labels = torch.tensor([[IGNORE, 0, 1]])
    w = position_weights(3, 1.0).double()
    parts = opd_loss(d, t, labels, w, alpha=0.8, tau=0.6, temperature=2.0)
    assert parts.ce.item() == pytest.approx(1.229469, abs=2e-6)
    assert parts.kl.item() == pytest.approx(0.784358, abs=2e-6)
    assert parts.loss.item() == pytest.approx(1.140446, abs=2e-6)
    assert int(parts.clipped) == 1
    # the clipped slot's gradient is the CE term's alone
    parts.loss.backward()
    d2 = d.detach().clone().requires_grad_()
    (0.8 * opd_loss(d2, t, labels, w, alpha=1.0, temperature=2.0).loss).backward()
    assert torch.allclose(d.grad[0, 2], d2.grad[0, 2], atol=1e-12)
    assert not torch.allclose(d.grad[0, 1], d2.grad[0, 1], atol=1e-6)
    # ours, as an option: slot-count denominator and no T^2
    ours = opd_loss(d, t, labels, w, alpha=0.8, tau=0.6, temperature=2.0, t_squared=False,
                    kl_norm=2.0)
    assert ours.loss.item() == pytest.approx(1.016390, abs=2e-6)
