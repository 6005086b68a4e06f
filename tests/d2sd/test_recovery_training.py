"""The recovery drafter's offline recipe: variable-prefix blocks, their loss, and a short run
that learns from them (tiny models)."""

from __future__ import annotations

import random

import torch

from training_job import d2sd_recovery as rec
from training_job.block_losses import IGNORE
from training_job.dflash_offline import DrafterTrainConfig, build_drafter, drafter_forward

MASK = 3


def _toy_drafter(block=4):
    from transformers import Qwen3Config

    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    d = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=block), MASK)
    d.share_target_modules(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    return d.eval()


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
    d = _toy_drafter().train()
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


def test_first_drafter_chain_finds_the_first_wrong_slot():
    """The chain depends on the anchor's token and the context before it only, so the tokens
    after the anchor can be set to the chain's own: right for slots 1..2, wrong at 3."""
    torch.manual_seed(1)
    d = _toy_drafter(block=6)
    ids = torch.randint(8, 64, (1, 20))
    feats = torch.randn(1, 20, 64)
    chain, _ = rec.first_drafter_chain(d, feats, ids, [20], [[5]], 6, MASK)
    ids[0, 6:8] = chain[0, 1:3]
    ids[0, 8] = (chain[0, 3] + 1) % 64
    again, fail = rec.first_drafter_chain(d, feats, ids, [20], [[5]], 6, MASK)
    assert torch.equal(again, chain) and fail.tolist() == [3]
    ids[0, 8:11] = chain[0, 3:6]  # every labelled slot right: no failure inside the block
    assert rec.first_drafter_chain(d, feats, ids, [20], [[5]], 6, MASK)[1].tolist() == [6]


def test_failure_placed_prefixes_end_before_the_first_wrong_slot():
    rng = random.Random(0)
    fail = torch.tensor([3, 16, 1, 5])  # 16 = B: the chain never fails there
    placed = rec.place_prefixes([[4, 9], [2, 7]], [40, 40], fail, 16, rng, share=1.0)
    assert placed[0][0] == 2 and placed[1] == [0, 4]
    assert 0 <= placed[0][1] <= 14  # no failure: an ordinary sampled prefix
    for seed in range(20):  # without failures to place, share changes nothing
        r1, r2 = random.Random(seed), random.Random(seed)
        no_fail = torch.full((2,), 16)
        assert rec.place_prefixes([[4, 9]], [40], no_fail, 16, r1, 1.0) == [rec.sample_prefixes([4, 9], 40, 16, r2)]


def test_exclusion_removes_the_chain_token_only_where_it_is_wrong():
    """Slot p+1 is read as 'best token other than the chain's'; where the chain is right there the
    branch is never used and the slot gets no weight. Other slots are untouched."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 8, requires_grad=True)
    labels = torch.tensor([[IGNORE, 5, 6, 7], [IGNORE, IGNORE, 2, 3]])
    chain = torch.tensor([[0, 4, 6, 1], [0, 0, 2, 5]])  # row 0: slot 1 wrong (4 != 5); row 1: slot 2 right
    prefixes = torch.tensor([0, 1])
    w = rec.prefix_weights(prefixes, 4, 7.0)
    out, w2 = rec.exclusion_at_prefix(logits, labels, w, chain, prefixes)
    assert out[0, 1, 4] == float("-inf") and torch.isfinite(out[0, 1, [0, 1, 2, 3, 5, 6, 7]]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, 2:]).all()
    assert w2[1, 2] == 0 and w2[1, 3] == w[1, 3] and torch.equal(w2[0], w[0])
    loss = rec.weighted_ce_rows(out, labels, w2)
    loss.backward()
    assert torch.isfinite(loss)
    assert logits.grad[0, 1, 4] == 0  # the excluded token gets no gradient
    assert (logits.grad[1, 2] == 0).all()  # the unweighted slot neither
    assert logits.grad[0, 1, 5] < 0 and logits.grad[1, 3].abs().sum() > 0
    # against a hand computation: slot 1 of row 0 is CE over the 7 other tokens
    keep = [0, 1, 2, 3, 5, 6, 7]
    hand = -torch.log_softmax(logits[0, 1, keep].detach(), 0)[keep.index(5)]
    ce = torch.nn.functional.cross_entropy(out[:, :, :].flatten(0, 1).detach(), labels.flatten().clamp(min=0),
                                           reduction="none").view(2, 4)
    torch.testing.assert_close(ce[0, 1], hand)


def test_failure_placed_training_runs_and_learns():
    torch.manual_seed(0)
    d = _toy_drafter()
    first = _toy_drafter()
    ids = torch.randint(8, 64, (2, 16))
    feats = torch.randn(2, 16, 64)
    anchors = [[2, 6, 9], [4, 8, 11]]
    chain, fail = rec.first_drafter_chain(first, feats, ids, [16, 16], anchors, 4, MASK)
    prefixes = rec.place_prefixes(anchors, [16, 16], fail, 4, random.Random(0), share=1.0)
    b = rec.make_prefix_blocks(ids, [16, 16], anchors, prefixes, 4, MASK)
    flat = torch.tensor([p for ps in prefixes for p in ps])
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        logits, w = rec.exclusion_at_prefix(d.logits(drafter_forward(d, feats, b)), b.labels,
                                            rec.prefix_weights(flat, 4, 7.0), chain, flat)
        loss = rec.weighted_ce_rows(logits, b.labels, w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_evaluation_at_first_failure_reads_both_drafters():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    target = Qwen3ForCausalLM(tc).eval()
    d = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4), MASK)
    d.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    seqs = [{"prompt_ids": torch.randint(8, 64, (5,)).tolist(), "output_ids": torch.randint(8, 64, (12,)).tolist()}
            for _ in range(6)]
    out = rec.evaluate(target, d, seqs, [0, 1], 4, MASK, 0, first=d, width=2)
    f = out["at_first_failure"]
    assert f["anchors"] > 0 and f["width"] == 2
    assert 0 <= f["recovery_top1"] <= f["recovery_top2"] <= 1
    assert 0 <= f["first_next_top1"] <= f["first_next_top2"] <= 1
    s1 = out["at_slot1_failure"]  # a subset of the first-failure anchors
    assert 0 < s1["anchors"] <= f["anchors"] and 0 <= s1["recovery_top1"] <= s1["recovery_top2"] <= 1
    assert "at_first_failure" not in rec.evaluate(target, d, seqs, [0, 1], 4, MASK, 0)


def test_export_writes_a_recovery_checkpoint_under_the_version_asked(tmp_path):
    import json

    from transformers import Qwen3Config

    from sglang_adaflash.d2sd.recovery_drafter import check_recovery_config
    from sglang_adaflash.drafter.checkpoint import read_config
    from sglang_adaflash.drafter.manifest import verify_manifest_files

    Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2).save_pretrained(tmp_path / "target")
    first = _toy_drafter()
    out = rec.export(first, tmp_path / "target", tmp_path / "rec", rec.RecoveryTrainConfig(steps=1), {"steps": 1},
                     {"trained": {}}, version="recovery-v7")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == "recovery-v7" and manifest["parent"] is None
    verify_manifest_files(out)
    check_recovery_config(read_config(out), first, str(out))  # the engine's check accepts it


def test_max_prefix_caps_sampled_and_placed_prefixes():
    """`--max-prefix 0` trains the slot-1 branch alone: no sampled prefix above the cap, and a
    failure past slot cap + 1 is not placed (its anchor keeps a sampled prefix)."""
    rng = random.Random(0)
    for cap in (0, 3):
        for _ in range(200):
            (p,) = rec.sample_prefixes([5], 40, 16, rng, max_prefix=cap)
            assert 0 <= p <= cap
    fail = torch.tensor([1, 5, 3, 16])
    placed = rec.place_prefixes([[4, 9], [2, 7]], [40, 40], fail, 16, random.Random(1), share=1.0, max_prefix=2)
    assert placed[0][0] == 0 and placed[1][0] == 2  # failures at slots 1 and 3 placed
    assert placed[0][1] <= 2 and placed[1][1] <= 2  # slot 5 is past the cap: sampled, capped
    assert rec.place_prefixes([[4]], [40], torch.tensor([5]), 16, random.Random(1), 1.0, max_prefix=0) == [[0]]


def test_branch_only_drops_whole_blocks_where_the_chain_is_right():
    labels = torch.tensor([[IGNORE, 5, 6, 7], [IGNORE, 4, 2, 3]])
    chain = torch.tensor([[0, 4, 6, 1], [0, 4, 2, 5]])  # row 0: slot 1 wrong; row 1: slot 1 right
    prefixes = torch.tensor([0, 0])
    logits = torch.zeros(2, 4, 8)
    w = rec.prefix_weights(prefixes, 4, 7.0)
    _, plain = rec.exclusion_at_prefix(logits, labels, w, chain, prefixes)
    _, only = rec.exclusion_at_prefix(logits, labels, w, chain, prefixes, branch_only=True)
    assert plain[1, 1] == 0 and plain[1, 2:].gt(0).all()  # without it, the later slots keep their weight
    assert (only[1] == 0).all() and torch.equal(only[0], plain[0])


def test_recipe_options_recorded_and_checked(tmp_path, capsys):
    import json

    import pytest
    from transformers import Qwen3Config

    from sglang_adaflash.drafter.checkpoint import read_config

    Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2).save_pretrained(tmp_path / "target")
    out = rec.export(_toy_drafter(), tmp_path / "target", tmp_path / "rec",
                     rec.RecoveryTrainConfig(steps=1, max_prefix=0), {"steps": 1}, {"trained": {}})
    assert read_config(out).raw["adaflash_config"]["recovery_drafter"]["prefix_range"] == [0, 0]
    again = rec.export(_toy_drafter(), tmp_path / "target", tmp_path / "rec2", rec.RecoveryTrainConfig(steps=1),
                       {"steps": 1}, {"trained": {}}, initialised_from="recovery drafter recovery-shared-v1")
    marker = read_config(again).raw["adaflash_config"]["recovery_drafter"]
    assert marker["initialised_from"] == "recovery drafter recovery-shared-v1" and marker["prefix_range"] == [0, 2]
    assert json.loads((out / "manifest.json").read_text())["version"] == "recovery-v1"
    with pytest.raises(ValueError, match="exclude_chain"):
        rec.train(None, None, _toy_drafter(), [], rec.RecoveryTrainConfig(branch_only=True), tmp_path / "w",
                  first=_toy_drafter())
    for bad, msg in ((["--branch-only"], "needs --exclude-chain"), (["--max-prefix", "-1"], ">= 0"),
                     (["--gamma", "0"], "> 0"), (["--gamma", "nan"], "> 0"), (["--gamma", "inf"], "> 0")):
        with pytest.raises(SystemExit):
            rec.main(["--target", "t", "--init", "i", "--data", "d", "--work", "w", "--out", "o", *bad])
        assert msg in capsys.readouterr().err


def test_init_is_named_by_its_version_or_file_name(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "manifest.json").write_text('{"version": "recovery-shared-v1"}')
    assert rec._init_name(tmp_path / "ck") == "recovery-shared-v1"
    assert rec._init_name(tmp_path / "drafter_ckpt.pt") == "drafter_ckpt.pt"
    for broken in ("{torn", "[1, 2]", '"v1"'):  # torn, or valid JSON that is not an object
        (tmp_path / "ck" / "manifest.json").write_text(broken)
        assert rec._init_name(tmp_path / "ck") == "ck"
