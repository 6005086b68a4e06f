"""The OPD round: it learns, it leaves the target and the length head alone, it resumes exactly."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target
from training_job.opd.train import (
    Interrupted,
    OPDConfig,
    Stopped,
    clip_sequence,
    train_head,
    train_opd,
)


def _seqs(n=6, seed=0, vocab=90):
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(3, 6))],
             "output_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(6, 12))]}
            for _ in range(n)]


def _cfg(**kw):
    base = dict(epochs=2, batch_size=3, anchors_per_seq=3, ckpt_every=2, seed=3, lr=3e-3,
                head_steps=2)
    base.update(kw)
    return OPDConfig(**base)


def _state(d):
    return {k: v.detach().clone() for k, v in d.state_dict().items()}


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0).model


@pytest.mark.parametrize("head", ["joint", "refit"])
def test_round_lowers_the_loss_and_touches_only_the_drafter(target, tmp_path, head):
    """The target stays frozen; the length head trains in the same steps ("joint", the
    reference's way) or is left for the refit after them ("refit")."""
    drafter = tiny_drafter(seed=1)
    before = _state(drafter)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    stats = train_opd(target, drafter, _seqs(), _cfg(epochs=6, head=head), tmp_path)
    assert stats["steps"] == 12 and stats["algorithm"] == "opd-rkl"
    assert stats["final_loss"] < stats["first_loss"]
    after = _state(drafter)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    head_changed = any(k.startswith("thresh_head") for k in changed)
    assert head_changed == (head == "joint")
    assert ("length_head" in stats) == (head == "joint")
    assert "fc.weight" in changed and "layers.0.self_attn.q_proj.weight" in changed
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in target_before.items())


def test_the_joint_head_reads_detached_states(target):
    """The head's loss sends no gradient into the drafter (the reference trains it on detached
    states), and the drafter's loss none into the head."""
    from training_job.dflash_offline import position_weights
    from training_job.opd.train import Parallel, step_loss

    drafter = tiny_drafter(seed=1)
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    for p in drafter.parameters():
        p.requires_grad_(True)
    w = position_weights(drafter.config.block_size, 7.0)
    for drafter_loss, head_loss in ((False, True), (True, False)):
        drafter.zero_grad(set_to_none=True)
        out = step_loss(target, drafter, _seqs(), [0, 1, 2], 0, _cfg(), w, 0, Parallel(),
                        drafter_loss=drafter_loss, head_loss=head_loss)
        out.loss.backward()
        grads = {n: p.grad for n, p in drafter.named_parameters()}
        head_grad = [g for n, g in grads.items() if n.startswith("thresh_head")]
        body_grad = [g for n, g in grads.items() if not n.startswith("thresh_head")]
        assert all(g is not None for g in (head_grad if head_loss else body_grad))
        assert all(g is None for g in (body_grad if head_loss else head_grad))


def test_interrupted_round_resumes_to_the_same_weights(target, tmp_path):
    seqs = _seqs(7, seed=1)
    full = tiny_drafter(seed=1)
    train_opd(target, full, seqs, _cfg(), tmp_path / "a")
    broken = tiny_drafter(seed=1)
    with pytest.raises(Interrupted):
        train_opd(target, broken, seqs, _cfg(), tmp_path / "b", stop_after=3)
    resumed = tiny_drafter(seed=1)  # a new process starts from the parent again
    logged = []
    stats = train_opd(target, resumed, seqs, _cfg(), tmp_path / "b", log=logged.append)
    assert stats["steps"] == 6
    assert [e["step"] for e in logged] == [3, 4, 5, 6]  # from the step-2 checkpoint
    for k, v in _state(full).items():
        assert torch.allclose(v, resumed.state_dict()[k], atol=1e-10), k


def _greedy(target, seqs, n=8):
    out = []
    for s in seqs:
        ids = torch.tensor([s["prompt_ids"]])
        gen = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        out.append({"prompt_ids": s["prompt_ids"], "output_ids": gen[0, ids.shape[1]:].tolist()})
    return out


def test_osd_is_ce_on_the_data_and_opd_ce_is_on_the_target_argmax(target, tmp_path):
    """On the target's own greedy responses the two CE terms coincide; on other text they do
    not (OPD's hard label is what the target would say, OSD's what the text says)."""
    off = _seqs(seed=4)
    on = _greedy(target, off)
    first = {}
    for name, data in (("on", on), ("off", off)):
        for loss in ("rkl", "sft"):
            stats = train_opd(target, tiny_drafter(seed=1), data,
                              _cfg(loss=loss, alpha=1.0, epochs=1), tmp_path / name / loss)
            first[name, loss] = stats["first_loss"]
            assert stats["algorithm"] == {"rkl": "opd-rkl", "sft": "osd-ce"}[loss]
    assert first["on", "rkl"] == pytest.approx(first["on", "sft"], rel=1e-9)
    assert abs(first["off", "rkl"] - first["off", "sft"]) > 1e-3


def test_fkl_and_rkl_differ_only_in_the_soft_term(target, tmp_path):
    """Same data, same CE: with alpha 1 the two KL variants take identical steps; with a soft
    term they do not."""
    seqs = _seqs(seed=5)
    weights = {}
    for alpha in (1.0, 0.5):
        for loss in ("rkl", "fkl"):
            drafter = tiny_drafter(seed=1)
            stats = train_opd(target, drafter, seqs,
                              _cfg(loss=loss, alpha=alpha, tau=1e9, epochs=1),
                              tmp_path / f"{alpha}" / loss)
            weights[alpha, loss] = drafter.state_dict()["fc.weight"].detach().clone()
            assert stats["algorithm"] == f"opd-{loss}" and stats["loss"] == loss
    assert torch.equal(weights[1.0, "rkl"], weights[1.0, "fkl"])
    assert (weights[0.5, "rkl"] - weights[0.5, "fkl"]).abs().max() > 1e-6


def test_old_algorithm_names_map_onto_losses():
    assert OPDConfig.from_dict({"algorithm": "osd"}).loss == "sft"
    assert OPDConfig.from_dict({"algorithm": "opd"}).loss == "rkl"
    with pytest.raises(ValueError, match="loss must be one of"):
        OPDConfig(loss="kl")


def test_should_stop_checkpoints_and_the_round_resumes_to_the_same_weights(target, tmp_path):
    seqs = _seqs(7, seed=1)
    full = tiny_drafter(seed=1)
    train_opd(target, full, seqs, _cfg(), tmp_path / "a")
    asked = []

    def stop_at_3():
        asked.append(1)
        return len(asked) >= 3

    with pytest.raises(Stopped):
        train_opd(target, tiny_drafter(seed=1), seqs, _cfg(), tmp_path / "b",
                  should_stop=stop_at_3)
    resumed = tiny_drafter(seed=1)
    logged = []
    train_opd(target, resumed, seqs, _cfg(), tmp_path / "b", log=logged.append)
    assert [e["step"] for e in logged] == [4, 5, 6]  # the stop saved step 3, not step 2
    for k, v in _state(full).items():
        assert torch.allclose(v, resumed.state_dict()[k], atol=1e-10), k


def test_head_is_refit_only_when_the_parent_has_one(target, tmp_path):
    with_head = tiny_drafter(seed=1)
    before = _state(with_head)
    assert train_head(target, with_head, _seqs(), _cfg(), tmp_path / "j") is None  # joint
    out = train_head(target, with_head, _seqs(), _cfg(head="refit"), tmp_path / "a")
    assert out["steps"] == 2 and out["mode"] == "refit"
    assert not torch.equal(before["thresh_head_two_model.out.weight"],
                           with_head.state_dict()["thresh_head_two_model.out.weight"])
    plain = tiny_drafter(seed=1, head=False)
    assert train_head(target, plain, _seqs(), _cfg(head="refit"), tmp_path / "b") is None
    assert plain.length_head is None


def test_clip_sequence_drops_oldest_prompt_tokens_first():
    s = {"prompt_ids": list(range(10)), "output_ids": [50, 51, 52]}
    assert clip_sequence(s, 8) == {"prompt_ids": [5, 6, 7, 8, 9], "output_ids": [50, 51, 52]}
    long = {"prompt_ids": [1, 2], "output_ids": list(range(20))}
    c = clip_sequence(long, 6)
    assert c["prompt_ids"] == [2] and c["output_ids"] == list(range(5))
