"""Cascade attention's pieces: the LSE merge of two key sets, and choosing a backend."""

import pytest
import torch

from sglang_adaflash.d2sd import cascade
from sglang_adaflash.d2sd.cascade import attend_with_lse, merge


def _qkv(seed=0, bs=2, nh=4, kvh=2, q_len=5, s=9, hd=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bs, nh, q_len, hd, generator=g, dtype=torch.float64)
    k = torch.randn(bs, kvh, s, hd, generator=g, dtype=torch.float64)
    v = torch.randn(bs, kvh, s, hd, generator=g, dtype=torch.float64)
    mask = torch.rand(bs, 1, q_len, s, generator=g) < 0.7
    mask[..., 0] = True  # every query sees a key of the first set
    mask[..., -1] = True  # and of the second
    return q, k, v, mask


def test_merge_of_two_key_sets_equals_attention_over_their_union():
    q, k, v, mask = _qkv()
    split, scale = 4, 8 ** -0.5
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    o_a, s_a = attend_with_lse(q, k[:, :, :split], v[:, :, :split], mask[..., :split], scale)
    o_b, s_b = attend_with_lse(q, k[:, :, split:], v[:, :, split:], mask[..., split:], scale)
    o, s = merge(o_a, s_a, o_b, s_b)
    torch.testing.assert_close(o, full, rtol=1e-10, atol=1e-10)
    o_all, s_all = attend_with_lse(q, k, v, mask, scale)
    torch.testing.assert_close(s, s_all, rtol=1e-10, atol=1e-10)
    # control: the LSEs swapped between the sets weight them wrongly, and the check sees it
    wrong, _ = merge(o_a, s_b, o_b, s_a)
    assert not torch.allclose(wrong, full, atol=1e-3)


def test_a_query_that_sees_nothing_in_one_set_takes_the_other_alone():
    q, k, v, mask = _qkv(seed=1)
    mask[:, :, 0, :4] = False  # query 0 sees no key of the first set
    scale = 0.3
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    o_a, s_a = attend_with_lse(q, k[:, :, :4], v[:, :, :4], mask[..., :4], scale)
    assert torch.isinf(s_a[:, :, 0]).all() and not torch.isnan(o_a).any()
    o, _ = merge(o_a, s_a, *attend_with_lse(q, k[:, :, 4:], v[:, :, 4:], mask[..., 4:], scale))
    torch.testing.assert_close(o, full, rtol=1e-10, atol=1e-10)


def test_backend_choice():
    assert cascade.select("auto", "cpu", torch.float32) == "masked"
    assert cascade.select("auto", "cpu", torch.bfloat16) == "masked"  # FlashInfer has no CPU kernels
    assert cascade.select("torch", "cpu", torch.float32) == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        cascade.select("flashinfer", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="head size in"):
        cascade.select("flashinfer", "cuda", torch.bfloat16, head_dim=32)
    with pytest.raises(ValueError, match="must be one of"):
        cascade.select("cascade", "cpu", torch.float32)
    assert cascade.make("masked", "cpu") is None
    assert isinstance(cascade.make("torch", "cpu"), cascade.TorchCascade)
