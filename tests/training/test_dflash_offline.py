from __future__ import annotations

import math
import random

import torch

from training_job.block_losses import (
    IGNORE,
    accept_lengths,
    make_blocks,
    position_weights,
    sample_anchors,
    weighted_ce,
)
from training_job.dflash_offline import DrafterTrainConfig, build_drafter, drafter_forward

MASK = 3


def test_blocks_labels_positions_and_mask():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0], [20, 21, 22, 23, 24, 25, 26, 27]])
    b = make_blocks(ids, [6, 8], [[2, 4], [5]], block_size=4, mask_token_id=MASK)
    assert b.seq_indices.tolist() == [0, 0, 1]
    assert b.input_ids.tolist() == [[12, MASK, MASK, MASK], [14, MASK, MASK, MASK],
                                    [25, MASK, MASK, MASK]]
    assert b.positions.tolist() == [[2, 3, 4, 5], [4, 5, 6, 7], [5, 6, 7, 8]]
    # Slot k is the token at anchor + k; past the sequence's end and slot 0 are ignored.
    assert b.labels.tolist() == [[IGNORE, 13, 14, 15], [IGNORE, 15, IGNORE, IGNORE],
                                 [IGNORE, 26, 27, IGNORE]]
    # Context keys strictly before the anchor; the block's own keys, all of them.
    assert b.mask.shape == (3, 1, 4, 8 + 4)
    ctx, own = b.mask[:, 0, :, :8], b.mask[:, 0, :, 8:]
    assert ctx[0].all(dim=0).tolist() == [True, True] + [False] * 6
    assert ctx[2].all(dim=0).tolist() == [True] * 5 + [False] * 3
    assert own.all()


def test_blocks_never_see_each_other():
    """Perturbing one block's tokens changes no other block's output (same sequence)."""
    torch.manual_seed(0)
    from transformers import Qwen3Config

    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg = DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4)
    d = build_drafter(tc, cfg, MASK).eval()
    emb = torch.nn.Embedding(64, 32)
    d.share_target_modules(emb, torch.nn.Linear(32, 64, bias=False))
    ids = torch.randint(8, 64, (1, 12))
    feats = torch.randn(1, 12, 64)
    b = make_blocks(ids, [12], [[3, 7]], 4, MASK)
    h1 = drafter_forward(d, feats, b)
    ids2 = ids.clone()
    ids2[0, 7] = (ids[0, 7] + 1) % 64  # the second block's anchor token
    h2 = drafter_forward(d, feats, make_blocks(ids2, [12], [[3, 7]], 4, MASK))
    assert torch.allclose(h1[0], h2[0], atol=1e-6)
    assert not torch.allclose(h1[1], h2[1])
    # Features at or after an anchor never reach that block.
    feats2 = feats.clone()
    feats2[0, 3:] += 1.0
    h3 = drafter_forward(d, feats2, b)
    assert torch.allclose(h1[0], h3[0], atol=1e-6)


def test_position_weights_and_weighted_ce():
    w = position_weights(4, 7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(w[3].item(), math.exp(-2 / 7), rel_tol=1e-6)
    labels = torch.tensor([[IGNORE, 1, 2, IGNORE]])
    logits = torch.full((1, 4, 5), -10.0)
    logits[0, 1, 1] = logits[0, 2, 2] = 10.0
    assert weighted_ce(logits, labels, w).item() < 1e-6
    logits[0, 2, 2] = -10.0  # slot 2 now uniform over 5 tokens: CE ln 5, weight exp(-1/7)
    want = math.exp(-1 / 7) * math.log(5) / (1 + math.exp(-1 / 7))
    assert math.isclose(weighted_ce(logits, labels, w).item(), want, rel_tol=1e-4)


def test_accept_lengths_and_anchors():
    labels = torch.tensor([[IGNORE, 5, 6, 7], [IGNORE, 5, 6, IGNORE], [IGNORE, 1, 2, 3]])
    props = torch.tensor([[0, 5, 6, 9], [0, 5, 6, 0], [0, 9, 2, 3]])
    assert accept_lengths(props, labels).tolist() == [2, 2, 0]
    a = sample_anchors(prompt_len=5, seq_len=12, num=100, rng=random.Random(0))
    assert a == list(range(5, 11))
    assert sample_anchors(5, 6, 3, random.Random(0)) == []


def test_drafter_loss_goes_down_on_a_fixed_toy_batch():
    torch.manual_seed(0)
    from transformers import Qwen3Config

    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg = DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4)
    d = build_drafter(tc, cfg, MASK)
    d.share_target_modules(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    ids = torch.randint(8, 64, (2, 16))
    feats = torch.randn(2, 16, 64)
    b = make_blocks(ids, [16, 16], [[2, 6, 9], [4, 8, 11]], 4, MASK)
    w = position_weights(4, 7.0)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = weighted_ce(d.logits(drafter_forward(d, feats, b)), b.labels, w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_distill_kl_by_hand_and_its_weights():
    """KL(p_teacher || p_drafter) per slot, weighted like the cross-entropy, by hand."""
    from training_job.dflash_offline import distill_kl

    w = position_weights(3, 7.0)  # [0, 1, exp(-1/7)]
    labels = torch.tensor([[IGNORE, 1, 0]])
    teacher = torch.log(torch.tensor([[[0.5, 0.5], [0.5, 0.5], [0.9, 0.1]]]))
    student = torch.log(torch.tensor([[[0.1, 0.9], [0.25, 0.75], [0.9, 0.1]]]))
    kl1 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # slot 1; slot 2 agrees: 0
    got = distill_kl(student, teacher, labels, w).item()
    assert math.isclose(got, kl1 / (1 + math.exp(-1 / 7)), rel_tol=1e-5)
    # slot 0 never counts (its weight is 0) however far apart the two are there
    student[0, 0] = torch.log(torch.tensor([0.99, 0.01]))
    assert math.isclose(distill_kl(student, teacher, labels, w).item(), got, rel_tol=1e-6)
    # an IGNORE label drops its slot
    labels[0, 2] = IGNORE
    student[0, 2] = torch.log(torch.tensor([0.1, 0.9]))
    assert math.isclose(distill_kl(student, teacher, labels, w).item(), kl1, rel_tol=1e-5)
    # temperature: both softened, times T^2
    t = 2.0
    p = torch.softmax(teacher[0, 1] / t, -1)
    q = torch.softmax(student[0, 1] / t, -1)
    want = float((p * (p.log() - q.log())).sum()) * t * t
    assert math.isclose(distill_kl(student, teacher, labels, w, t).item(), want, rel_tol=1e-5)


def test_teacher_logits_read_the_position_before_each_slot():
    """Slot k of a block at anchor a is labelled with token a+k, which the target predicts at
    a+k-1: the teacher row must be the target's logits there (an off-by-one reads a+k)."""
    from training_job.dflash_offline import block_teacher_logits

    class Target:
        lm_head = torch.nn.Identity()

    states = torch.arange(2 * 8, dtype=torch.float32).view(2, 8, 1)  # state = seq * 8 + position
    ids = torch.zeros(2, 8, dtype=torch.long)
    b = make_blocks(ids, [8, 8], [[2], [5]], 4, MASK)
    got = block_teacher_logits(Target(), states, b)[..., 0]
    assert got[0].tolist() == [1, 2, 3, 4]  # anchor 2: positions 1..4
    assert got[1].tolist() == [12, 13, 14, 15]  # sequence 1, anchor 5: positions 4..7


def test_loss_slots_keep_what_weighs_and_read_the_same_states():
    from training_job.dflash_offline import loss_slots

    assert loss_slots(16, 7.0) == 16  # the published weighting keeps the whole block
    assert loss_slots(16, 2.0) == 11  # exp(-9/2) >= 0.01 > exp(-10/2)
    assert loss_slots(4, 0.1) == 2  # never fewer than slot 0 and one proposal
    torch.manual_seed(0)
    from transformers import Qwen3Config

    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    d = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=6), MASK).eval()
    d.share_target_modules(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    ids = torch.randint(8, 64, (1, 16))
    b = make_blocks(ids, [16], [[3, 8]], 6, MASK)
    feats = torch.randn(1, 16, 64)
    full = drafter_forward(d, feats, b)
    lead = drafter_forward(d, feats, b, slots=4)
    assert lead.shape == (2, 4, 32) and torch.allclose(lead, full[:, :4], atol=1e-6)


def _tiny_target_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def test_warm_start_loads_every_weight_and_the_head_and_refuses_another_architecture(tmp_path):
    import pytest

    from sglang_adaflash.drafter.checkpoint import save_drafter
    from training_job.dflash_offline import warm_start

    torch.manual_seed(0)
    cfg = DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4)
    trained = build_drafter(_tiny_target_config(), cfg, MASK)
    trained.ensure_length_head()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    save_drafter(tmp_path / "base", trained)
    fresh = build_drafter(_tiny_target_config(), cfg, MASK)
    assert fresh.length_head is None
    warm_start(fresh, tmp_path / "base")
    assert fresh.length_head is not None
    mine, theirs = fresh.state_dict(), trained.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k
    # A recipe that builds another drafter is refused, not half-loaded.
    other = build_drafter(_tiny_target_config(), DrafterTrainConfig(target_layer_ids=[0, 1], block_size=8), MASK)
    with pytest.raises(ValueError, match="block_size"):
        warm_start(other, tmp_path / "base")
    narrow = build_drafter(_tiny_target_config(), DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4,
                                                                     intermediate_size=32), MASK)
    with pytest.raises(ValueError, match="wider"):
        warm_start(narrow, tmp_path / "base")


def test_a_wider_drafter_starts_as_the_function_it_grew_from_and_its_new_units_learn(tmp_path):
    from sglang_adaflash.drafter.checkpoint import save_drafter
    from training_job.dflash_offline import warm_start

    torch.manual_seed(0)
    tc = _tiny_target_config()
    embed, head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False)
    base = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4), MASK)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.5 * torch.randn_like(p))  # trained-looking: down_proj far from zero
    save_drafter(tmp_path / "base", base)
    wide = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4, intermediate_size=160), MASK)
    warm_start(wide, tmp_path / "base")
    assert wide.layers[0].mlp.gate_proj.weight.shape == (160, 32)
    for d in (base, wide):
        d.share_target_modules(embed, head)
    ids = torch.randint(8, 64, (2, 16))
    feats = torch.randn(2, 16, 64)
    b = make_blocks(ids, [16, 16], [[2, 6, 9], [4, 8, 11]], 4, MASK)
    with torch.no_grad():
        same = wide.logits(drafter_forward(wide, feats, b))
        torch.testing.assert_close(same, base.logits(drafter_forward(base, feats, b)), rtol=1e-5, atol=1e-5)
    new_cols = wide.layers[0].mlp.down_proj.weight[:, 64:]
    assert new_cols.abs().max() == 0
    new_rows = wide.layers[0].mlp.gate_proj.weight[64:]
    assert new_rows.abs().max() > 0  # fresh random rows, or the new units could never differ
    opt = torch.optim.AdamW(wide.parameters(), lr=1e-2)
    for _ in range(3):
        weighted_ce(wide.logits(drafter_forward(wide, feats, b)), b.labels, position_weights(4, 2.0)).backward()
        opt.step()
        opt.zero_grad()
    assert wide.layers[0].mlp.down_proj.weight[:, 64:].abs().max() > 0


def test_the_refined_recipe_starts_from_its_base_and_cuts_its_continuations_elsewhere(tmp_path):
    from training_job.drafter_data import continuation_contexts

    base = DrafterTrainConfig()
    r = base.refined(tmp_path / "drafter")
    assert r.init_from == str(tmp_path / "drafter") and r.continuation_passes == 2
    assert r.lr < base.lr and r.seed != base.seed
    assert (r.block_size, r.target_layer_ids, r.num_layers) == (base.block_size, base.target_layer_ids,
                                                                base.num_layers)

    class Tok:  # one id per character: cuts are visible as lengths
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 50 for c in text]}

    recs = [{"id": f"r{i}", "domain": "code", "prompt": "p", "response": "x" * 200} for i in range(20)]
    first = continuation_contexts(Tok(), recs)
    again = continuation_contexts(Tok(), recs)
    second = continuation_contexts(Tok(), recs, pass_=1)
    assert [c[0] for c in first] == [f"r{i}#cont" for i in range(20)]  # pass 0: the first recipe's ids
    assert [c[0] for c in second] == [f"r{i}#cont1" for i in range(20)]
    assert [len(c[2]) for c in first] == [len(c[2]) for c in again]  # seeded: a rebuild cuts alike
    assert sum(len(a[2]) != len(b[2]) for a, b in zip(first, second)) >= 15  # elsewhere


def test_the_problems_recipe_starts_from_the_second_stage_with_the_problems_added(tmp_path):
    base = DrafterTrainConfig()
    refined = base.refined(tmp_path / "drafter")
    p = base.with_problems(tmp_path / "drafter_refined")
    assert p.init_from == str(tmp_path / "drafter_refined")
    assert (p.code_problems, p.problems_repeat) == (6000, 2) and base.code_problems == 0
    assert p.continuation_passes == refined.continuation_passes  # the second stage's data, plus
    assert p.lr == refined.lr / 2 and p.min_lr == refined.min_lr / 2
    assert p.seed not in (base.seed, refined.seed)  # a new data order
    assert (p.block_size, p.target_layer_ids, p.num_layers, p.intermediate_size) == \
        (base.block_size, base.target_layer_ids, base.num_layers, base.intermediate_size)
