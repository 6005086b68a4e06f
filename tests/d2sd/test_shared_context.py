"""A recovery drafter that shares modules with the first drafter (shared_context.py).

Tying, and which sharing the engine then sees; the joint pass with shared modules against each
drafter's own forward (a pass that answered with the first drafter twice must fail: the
control); one context cache for both, through the proposer, also after an in-place write (hot
reload); T=0 equality with `ar` in every branch source; the checkpoint marker on the command
line, good and bad; and training with frozen shared modules."""

import pytest
import torch

from sglang_adaflash.d2sd.engine import D2SDEngine
from sglang_adaflash.d2sd.joint import JointDrafters
from sglang_adaflash.d2sd.recovery_drafter import RECOVERY_KEY, TreeProposer, recovery_marker
from sglang_adaflash.d2sd.shared_context import SHARING, shared_modules, sharing, tie_modules
from sglang_adaflash.engine.engine import SpecEngine
from sglang_adaflash.planner.cost import StepCostModel
from sglang_adaflash.testing.fixtures import TINY_VOCAB, tiny_drafter

from .conftest import recovery_for
from .test_d2sd_engine import _prompts, _run
from .test_joint import _inputs, _own


def _pair(kind, layers=1):
    first = tiny_drafter(seed=11, target_layers=3, layers=layers)
    rec = recovery_for(first, seed=12, target_layers=3, layers=layers)
    if kind is not None:
        tie_modules(rec, first, kind)
    return first, rec


def test_tying_makes_the_modules_the_first_drafters_and_sharing_reads_the_widest_kind():
    for layers in (1, 2):
        first, rec = _pair(None, layers)
        assert sharing(first, rec) is None and sharing(first, None) is None
        for kind in SHARING:
            tie_modules(rec, first, kind)
            assert sharing(first, rec) == kind
            for name in shared_modules(first.config, kind):
                assert rec.get_submodule(name) is first.get_submodule(name)
        assert rec.layers[0].mlp is not first.layers[0].mlp
    # context sharing reaches every layer's K/V projections; attention only layer 0's queries
    names = shared_modules(tiny_drafter(seed=1, layers=2).config, "attention")
    assert "layers.1.self_attn.k_proj" in names and "layers.1.self_attn.q_proj" not in names
    with pytest.raises(ValueError, match="sharing is one of"):
        shared_modules(first.config, "everything")


@pytest.mark.parametrize("kind", SHARING)
@pytest.mark.parametrize("layers", [1, 2])
def test_the_joint_pass_with_shared_modules_is_each_drafters_own(kind, layers):
    first, rec = _pair(kind, layers)
    feats, positions, embeds, block_pos, mask = _inputs(first)
    joint = JointDrafters(first, rec)
    assert joint.shared == kind
    with torch.inference_mode():
        kv, _ = joint.context_kv(feats, positions)  # one context: the first drafter's
        out_a, out_b = joint.forward(embeds, block_pos, kv, kv, mask)
        for d, out in ((first, out_a), (rec, out_b)):
            _, want = _own(d, feats, positions, embeds, block_pos, mask)
            torch.testing.assert_close(out, want)
        # control: the recovery drafter's own modules matter, so answering with the first's fails
        assert (out_a - out_b).abs().max() > 1e-3


@pytest.mark.parametrize("kind", SHARING)
def test_one_context_cache_serves_both_and_follows_an_in_place_write(kind):
    first, rec = _pair(kind)
    embed, head = torch.nn.Embedding(TINY_VOCAB, 48).double(), torch.nn.Linear(48, TINY_VOCAB).double()
    for d in (first, rec):
        d.share_target_modules(embed, head)  # the target's, one for both
    prop = TreeProposer(first, rec, num_slots=3, capacity=32, joint=True)
    assert prop.shared_context and prop.rcache is prop.cache
    feats, *_ = _inputs(first, n=2, ctx=(6, 6), seed=3)
    b = first.config.block_size

    def check():
        prop.extend_context(feats, torch.tensor([0, 0]), [2, 0])
        last, lens = torch.tensor([5, 7]), torch.tensor([6, 6])
        a, r = prop.propose_joint(last, lens, [2, 0])
        torch.testing.assert_close(a, prop.propose(last, lens, None, slots=[2, 0]))
        ids = torch.full((2, b), first.config.mask_token_id, dtype=torch.long)
        ids[:, 0] = last
        torch.testing.assert_close(r, prop.propose_branches(ids, lens, torch.tensor([2, 0])))
        return r

    with torch.inference_mode():
        before = check()
    assert not prop._lag  # nothing queued for a second cache
    with torch.no_grad():  # what hot reload does: write into the first drafter's parameters
        first.fc.weight.mul_(1.3)
        first.layers[0].self_attn.k_proj.weight.add_(0.05)
    assert torch.equal(rec.fc.weight, first.fc.weight)
    with torch.inference_mode():
        after = check()
    assert (after - before).abs().max() > 1e-4  # the recovery drafter reads the new context
    prop.move(2, 1, 6)  # one cache: moved once
    torch.testing.assert_close(prop.cache.k[0][1, :, :6], prop.cache.k[0][2, :, :6])


@pytest.mark.parametrize("source", ["joint", "recovery", "auto"])
@pytest.mark.parametrize("kind", SHARING)
def test_greedy_equals_ar_with_a_shared_recovery_drafter(target, drafter, source, kind):
    prompts = _prompts(5, seed=31)
    max_new = [9, 1, 17, 5, 12]
    ar = _run(SpecEngine(target, None, mode="ar", max_batch_size=3, max_seq_len=128), prompts, max_new)
    rec = recovery_for(drafter)
    tie_modules(rec, drafter, kind)
    rule = "load_aware" if source == "auto" else "fixed"  # auto prices the two sources
    eng = D2SDEngine(target, drafter, rec, tree_k=3, branch_len=3, branch_width=2, tree_rule=rule,
                     branch_drafter=source, max_batch_size=3, max_seq_len=128, cost_model=StepCostModel(1.0, 1e-4))
    assert eng.proposer.shared_context
    assert _run(eng, prompts, max_new) == ar
    assert eng.tree_stats["branches"] > 0


def test_training_with_shared_modules_leaves_them_and_marks_the_checkpoint(tmp_path):
    """The recipe's --share: the tied modules get no gradient step (they are the first
    drafter's), the rest learn, and the exported checkpoint loads tied."""
    import json

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sglang_adaflash.d2sd.recovery_drafter import load_recovery_drafter
    from sglang_adaflash.drafter.checkpoint import read_config
    from training_job import d2sd_recovery as recipe
    from training_job.dflash_offline import DrafterTrainConfig, build_drafter

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0)
    target = Qwen3ForCausalLM(tc).eval()
    tc.save_pretrained(tmp_path / "target")
    first = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4), 3)
    drafter = build_drafter(tc, DrafterTrainConfig(target_layer_ids=[0, 1], block_size=4), 3)
    drafter.load_state_dict(first.state_dict())
    for d in (first, drafter):
        d.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    for p in first.parameters():
        p.requires_grad_(False)
    tie_modules(drafter, first, "context")
    frozen = {n: p.detach().clone() for n, p in first.named_parameters()}
    own_before = drafter.layers[0].mlp.up_proj.weight.detach().clone()

    class Tok:
        pad_token_id = 0

    seqs = [{"prompt_ids": torch.randint(8, 64, (5,)).tolist(), "output_ids": torch.randint(8, 64, (14,)).tolist()}
            for _ in range(8)]
    cfg = recipe.RecoveryTrainConfig(steps=6, batch_size=2, anchors_per_seq=3, warmup_steps=1, ckpt_every=100,
                                     share="context")
    recipe.train(target, Tok(), drafter, seqs, cfg, tmp_path / "work", log=lambda s: None)
    for name in ("fc.weight", "layers.0.self_attn.k_proj.weight", "layers.0.input_layernorm.weight"):
        assert torch.equal(drafter.get_parameter(name), frozen[name]), name
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, own_before)  # the rest learned
    out = recipe.export(drafter, tmp_path / "target", tmp_path / "rec", cfg, {"steps": 6}, {"trained": {}})
    marker = json.loads((out / "config.json").read_text())["adaflash_config"][RECOVERY_KEY]
    assert marker == recovery_marker(prefix_range=[0, 2], initialised_from="dflash drafter", shared="context")
    loaded = load_recovery_drafter(out, first)
    assert sharing(first, loaded) == "context"
    assert read_config(out).raw["adaflash_config"][RECOVERY_KEY]["shared"] == "context"


@pytest.mark.parametrize("kind", [*SHARING, None])
@pytest.mark.parametrize("layers", [1, 2])
def test_the_recovery_drafters_rows_alone_equal_its_whole_blocks_rows(kind, layers):
    """With recovery_rows the pass makes the recovery drafter's states at those block rows only
    (a one-layer pair's last layer computes nothing else for it): they must equal its own
    forward's rows there, and the first drafter's states must not change. Control: rows one
    slot off differ."""
    first, rec = _pair(kind, layers)
    feats, positions, embeds, block_pos, mask = _inputs(first)
    joint = JointDrafters(first, rec)
    with torch.inference_mode():
        kv_a, kv_b = joint.context_kv(feats, positions)
        if kind is not None:  # one context: the first drafter's
            kv_b = kv_a
        whole_a, whole_b = joint.forward(embeds, block_pos, kv_a, kv_b, mask)
        for rows in (slice(1, 3), slice(1, 2), slice(2, 6)):
            a, b = joint.forward(embeds, block_pos, kv_a, kv_b, mask, recovery_rows=rows)
            torch.testing.assert_close(a, whole_a)
            torch.testing.assert_close(b, whole_b[:, rows])
            off = slice(rows.start + 1, rows.stop + 1)
            assert (b - whole_b[:, off]).abs().max() > 1e-3
