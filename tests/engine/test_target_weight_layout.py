"""The target's projection weights relaid out column-major on a CPU in float32
(target.weight_layout): the same values and Parameters, the same logits to rounding, tied and
non-float32 weights left alone, and the engine's T=0 output still plain decoding's."""

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from sglang_adaflash.target.hf_target import HFTarget, TargetBatch
from sglang_adaflash.target.weight_layout import column_major_linears
from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target

from .conftest import OracleProposer
from .test_lossless_greedy import _prompts, _run


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _qwen3(dtype=torch.float32, tie=False) -> nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                      intermediate_size=96, vocab_size=90, max_position_embeddings=256, tie_word_embeddings=tie)
    return Qwen3ForCausalLM(cfg).to(dtype).eval()


def test_a_float32_cpu_target_has_every_projection_column_major_with_its_values_and_parameters():
    model = _qwen3()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    target = HFTarget(model)
    lins = _linears(model)
    assert target.relaid_linears == len(lins) == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
    for m in lins:
        w = m.weight
        assert not w.is_contiguous() and w.t().is_contiguous(), w.stride()
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    assert column_major_linears(model) == 0  # already relaid out


def test_the_logits_are_the_row_major_weights_logits_to_rounding():
    target = HFTarget(_qwen3())
    batch = TargetBatch.from_lists([[5, 9, 2, 7, 7, 1], [3, 4]], [0, 0])
    column, _ = target.forward(batch, target.new_cache(2, 16))
    with torch.no_grad():
        for m in _linears(target.model):
            m.weight.data = m.weight.data.contiguous()
    row, _ = target.forward(batch, target.new_cache(2, 16))
    torch.testing.assert_close(column, row, rtol=1e-5, atol=1e-5)


def test_a_head_tied_to_the_embedding_gets_its_own_column_major_copy_and_the_embedding_stays_row_major():
    model = _qwen3(tie=True)
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight is table
    before = table.detach().clone()
    target = HFTarget(model)
    assert target.head_copied
    assert target.relaid_linears == len(_linears(model)) - 1  # the head is copied, not relaid in place
    head = model.lm_head.weight
    assert head is not table and head.data_ptr() != table.data_ptr()
    assert not head.is_contiguous() and head.t().is_contiguous(), head.stride()
    assert table.is_contiguous() and model.model.embed_tokens.weight is table  # an embedding reads rows
    assert torch.equal(head, before) and torch.equal(table, before)
    assert target.lm_head is model.lm_head and target.lm_head.weight is head
    batch = TargetBatch.from_lists([[5, 9, 2, 7], [3, 4]], [0, 0])
    copied, _ = target.forward(batch, target.new_cache(2, 16))
    with torch.no_grad():
        model.lm_head.weight = table  # tied again, row-major
    tied, _ = target.forward(batch, target.new_cache(2, 16))
    torch.testing.assert_close(copied, tied, rtol=1e-5, atol=1e-5)


def test_a_tied_head_over_the_copy_limit_stays_tied(monkeypatch):
    from sglang_adaflash.target import weight_layout

    model = _qwen3(tie=True)
    table = model.model.embed_tokens.weight
    monkeypatch.setattr(weight_layout, "TIED_HEAD_COPY_MAX_BYTES", table.numel() * table.element_size() - 1)
    target = HFTarget(model)
    assert not target.head_copied
    assert model.lm_head.weight is table and table.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_are_left_as_loaded(dtype):
    target = HFTarget(_qwen3(dtype))
    assert target.relaid_linears == 0 and not target.head_copied
    assert all(m.weight.is_contiguous() for m in _linears(target.model))


@pytest.mark.parametrize("mode", ["dflash", "adaflash", "adaflash-history"])
def test_greedy_output_on_a_relaid_float32_target_equals_plain_decoding_with_joins(mode):
    """T=0 in float32 with the weights relaid out, six requests through three slots: every
    speculative mode commits `ar`'s tokens (the proposer is the target's own continuation with
    mistakes, so multi-token verifies and rejections both happen)."""
    target = tiny_target(seed=4, dtype=torch.float32)
    assert target.relaid_linears > 0
    drafter = tiny_drafter(seed=5, dtype=torch.float32)
    prompts, max_new = _prompts(6, seed=8), [21, 5, 30, 12, 1, 17]
    ar = _run(target, None, "ar", prompts, max_new, batch=3)
    spec = _run(target, drafter, mode, prompts, max_new, batch=3, proposer=OracleProposer(target, drafter, error_rate=0.3))
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    taus = [t for o in spec for t in o.stats.accept_lens]
    assert max(taus) > 2 and any(n > max(1, t) for o in spec for n, t in zip(o.stats.verify_lens, o.stats.accept_lens))


def test_the_engines_drafter_is_column_major_and_a_reload_keeps_the_layout_with_the_new_values():
    """The DFlash proposer relays out a float32 drafter's projections as HFTarget does the
    target's; a hot reload (serving.reload's ModuleTarget.write: copies into the live tensors)
    lands the new version's values in that layout."""
    from sglang_adaflash.engine.engine import SpecEngine
    from sglang_adaflash.serving.reload.apply import ModuleTarget

    drafter = tiny_drafter(seed=5, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    eng = SpecEngine(tiny_target(seed=4, dtype=torch.float32), drafter, mode="adaflash", max_batch_size=2,
                     max_seq_len=32)
    lins = [m for m in _linears(drafter) if min(m.weight.shape) > 1]  # a vector's layout cannot change
    assert eng.proposer.relaid_linears == len(lins) > 0
    assert all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in lins)
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())
    new = {k: v + 1.0 for k, v in before.items()}
    ModuleTarget(drafter).write(new)
    assert all(torch.equal(v, new[k]) for k, v in drafter.state_dict().items())
    assert all(m.weight.t().is_contiguous() for m in lins)


def test_greedy_output_with_the_real_drafter_relaid_in_float32_equals_plain_decoding_with_joins():
    """The DFlash proposer on a float32 drafter (column-major, RoPE from its table, one request
    without a mask): proposals are the drafter's own, the output still ar's."""
    target = tiny_target(seed=4, dtype=torch.float32)
    drafter = tiny_drafter(seed=5, dtype=torch.float32)
    prompts, max_new = _prompts(6, seed=8), [21, 5, 30, 12, 1, 17]
    ar = _run(target, None, "ar", prompts, max_new, batch=3)
    for mode, batch in (("dflash", 3), ("adaflash-history", 3), ("dflash", 1)):
        spec = _run(target, drafter, mode, prompts, max_new, batch=batch)
        assert [o.output_ids for o in spec] == [o.output_ids for o in ar], (mode, batch)
