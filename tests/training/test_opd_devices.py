"""Every tensor a collective sees lives on the training device (NCCL refuses host tensors).

No GPU here, so the models run on PyTorch's ``meta`` device, which is not the host: shapes and
devices propagate, values do not. The collectives are replaced by recorders (a two-rank world
without a process group), and a training step's distributed parts run as they do under torchrun:
the batch-wide denominators, the gradient exchange, the statistics. A tensor built on the host
anywhere in that path (the old step all-reduced float64 host tensors) shows up as ``cpu``.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target
from training_job.dflash_offline import position_weights
from training_job.opd.train import OPDConfig, Parallel, exchange_and_clip, step_loss

META = torch.device("meta")


def _seqs():
    rng = random.Random(7)
    return [{"prompt_ids": [rng.randrange(1, 90) for _ in range(4)],
             "output_ids": [rng.randrange(1, 90) for _ in range(9)]} for _ in range(3)]


@pytest.fixture
def collectives(monkeypatch):
    """Record the device of every tensor handed to a collective."""
    seen: list[tuple[str, torch.device]] = []

    def all_reduce(t, op=None, group=None, async_op=False):
        seen.append(("all_reduce", t.device))

    def broadcast(t, src=0, group=None, async_op=False):
        seen.append(("broadcast", t.device))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    return seen


@pytest.mark.parametrize("scope", ["batch", "sequence"])
@pytest.mark.parametrize("indices,rank", [([0, 1, 2], 0), ([0, 1, 2], 1), ([0], 1)])
def test_a_steps_collectives_run_on_the_training_device(collectives, scope, indices, rank):
    """Rank 0 and 1 of a two-rank step, and a rank the last batch leaves without a sequence."""
    target = tiny_target(seed=0).model.to(META)
    drafter = tiny_drafter(seed=1).to(META)
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    params = list(drafter.parameters())
    for p in params:
        p.requires_grad_(True)
    cfg = OPDConfig(batch_size=3, anchors_per_seq=3, scope=scope)
    par = Parallel(rank=rank, world=2, device=META)
    out = step_loss(target, drafter, _seqs(), indices, 0, cfg,
                    position_weights(drafter.config.block_size, cfg.gamma), 0, par)
    if out.loss is not None:
        assert out.loss.device == META
        out.loss.backward()
    gnorm = exchange_and_clip(par, params, cfg.grad_clip)
    stats = par.sum_(out.stats)
    assert gnorm.device == META and stats.device == META
    kinds = [k for k, _ in collectives]
    # the gradients and the statistics always; the denominators too when the batch normalises
    assert kinds.count("all_reduce") == (3 if scope == "batch" else 2)
    assert {d for _, d in collectives} == {META}, collectives


def test_the_recorder_sees_a_host_tensor(collectives):
    """Control: a collective on a host tensor is caught."""
    Parallel(rank=0, world=2, device=META).sum_(torch.zeros(2))
    assert collectives == [("all_reduce", torch.device("cpu"))]
