"""Recalibrate the length head on records the round did not train on.

The head is refit after the drafter's epochs, on the same records: the drafter has just fitted
them, so the acceptance it shows there is higher than on new traffic, and a head fitted to it
over-predicts on what the deployment serves next (on the OPD benchmark's held-out math after five
rounds: 0.358 predicted against 0.301 actual). The round's held-out slice is new to this drafter,
so it shows the acceptance to expect. Two numbers are fitted on it (Platt scaling of the head's
score: ratio = sigmoid(a * score + c), a > 0), which moves the head's mean to the held-out
acceptance and keeps its ranking; the pair is folded into the head's output layer, so the
checkpoint's layout does not change.

The slice also feeds the gate, which is not affected: the gate measures tau with the whole block
verified, where the head plays no part.
"""

from __future__ import annotations

import random

import torch

from training_job.dflash_offline import (
    accept_lengths,
    collate,
    drafter_forward,
    make_blocks,
    sample_anchors,
    target_features,
)

#: Below this many held-out blocks two parameters are not worth fitting.
MIN_EXAMPLES = 64


@torch.no_grad()
def head_examples(target, drafter, seqs: list[dict], *, pad_id: int, anchors_per_seq: int,
                  batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(score, label) of the head on one block at each of `anchors_per_seq` random anchors per
    sequence: score is the head's pre-sigmoid output, label tau / B of the drafter's greedy
    proposals against the recorded response (the head's training label)."""
    from sglang_adaflash.drafter.length_head import length_label

    dc = drafter.config
    rng = random.Random(seed * 7919 + 17)
    usable = [s for s in seqs if len(s["output_ids"]) >= 2]
    scores, labels = [], []
    for i in range(0, len(usable), batch_size):
        batch = usable[i:i + batch_size]
        ids, lens, plens = collate(batch, pad_id)
        anchors = [sample_anchors(p, n, anchors_per_seq, rng) for p, n in zip(plens, lens)]
        blocks = make_blocks(ids, lens, anchors, dc.block_size, dc.mask_token_id)
        device = drafter.fc.weight.device  # the blocks are built on the host
        ids = ids.to(device)
        blocks = type(blocks)(*(t.to(device) for t in (
            blocks.seq_indices, blocks.input_ids, blocks.positions, blocks.labels, blocks.mask)))
        feats = target_features(target, ids, list(dc.target_layer_ids))
        hidden = drafter_forward(drafter, feats, blocks)
        acc = accept_lengths(drafter.logits(hidden).argmax(-1), blocks.labels)
        scores.append(drafter.length_head.logit(hidden).float())
        labels.append(length_label(acc, dc.block_size))
    if not scores:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(scores).cpu(), torch.cat(labels).cpu()


def fit_platt(score: torch.Tensor, label: torch.Tensor, iters: int = 100) -> tuple[float, float]:
    """(a, c) minimising mean (sigmoid(a * score + c) - label)^2 with a > 0 (a = exp(s))."""
    s = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    c = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    x, y = score.double(), label.double()
    opt = torch.optim.LBFGS([s, c], lr=0.5, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = ((torch.sigmoid(s.exp() * x + c) - y) ** 2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    return float(s.detach().exp()), float(c.detach())


def calibrate_head(target, drafter, seqs: list[dict], *, pad_id: int, anchors_per_seq: int,
                   batch_size: int, seed: int) -> dict:
    """Fit and fold the recalibration on `seqs` (held-out records); returns what the report
    records. Leaves the head as it is when there are too few blocks or the fit does not lower
    the error on them."""
    head = drafter.length_head
    if head is None:
        return {"applied": False, "reason": "no length head"}
    was_training = drafter.training
    drafter.eval()
    try:
        score, label = head_examples(target, drafter, seqs, pad_id=pad_id,
                                     anchors_per_seq=anchors_per_seq, batch_size=batch_size,
                                     seed=seed)
    finally:
        drafter.train(was_training)
    out = {"blocks": int(label.numel())}
    if label.numel() < MIN_EXAMPLES:
        return {**out, "applied": False, "reason": f"fewer than {MIN_EXAMPLES} held-out blocks"}
    a, c = fit_platt(score, label)
    before = torch.sigmoid(score.double())
    after = torch.sigmoid(a * score.double() + c)
    y = label.double()
    mse_before, mse_after = float(((before - y) ** 2).mean()), float(((after - y) ** 2).mean())
    out.update({"scale": round(a, 4), "shift": round(c, 4), "mean_label": round(float(y.mean()), 4),
                "mean_predicted_before": round(float(before.mean()), 4),
                "mean_predicted_after": round(float(after.mean()), 4),
                "mse_before": round(mse_before, 5), "mse_after": round(mse_after, 5)})
    if not mse_after < mse_before:
        return {**out, "applied": False, "reason": "the fit does not lower the held-out error"}
    head.recalibrate(a, c)
    return {**out, "applied": True}
